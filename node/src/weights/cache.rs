//! The in-cluster cache: a JetStream object store holding a model file as
//! one object per chunk, read as a load's source, and filled by
//! `dynamoctl models push`.

use super::*;

/// The name of chunk `i` of `sha` in the object store.
fn object(sha: &ContentHash, i: usize) -> String {
    format!("{}.{i}", sha.hex())
}

/// Puts `path` in the in-cluster cache, chunk by chunk; `progress` gets
/// the bytes stored so far. Answers its manifest.
pub async fn push(
    bus: &Bus,
    path: &Path,
    model: &str,
    progress: &mut (dyn FnMut(u64, u64) + Send),
) -> anyhow::Result<WeightManifest> {
    let p = path.to_path_buf();
    let m_model = model.to_string();
    let m =
        tokio::task::spawn_blocking(move || dynamo_weights::manifest::of_file(&p, &m_model, GGUF))
            .await??;
    let store = bus.object_store(&bus.subjects.weights_objects()).await?;
    let mut f = tokio::fs::File::open(path).await?;
    let mut done = 0u64;
    for i in 0..m.chunks.len() {
        let (_, len) = m.chunk(i);
        let mut buf = vec![0u8; len];
        f.read_exact(&mut buf).await?;
        if dynamo_weights::manifest::hash(&buf) != m.chunks[i] {
            anyhow::bail!("{} changed while it was read", path.display());
        }
        store
            .put(object(&m.sha256, i).as_str(), &mut buf.as_slice())
            .await
            .map_err(|e| anyhow::anyhow!("storing chunk {i}: {e}"))?;
        done += len as u64;
        progress(done, m.size);
    }
    let kv = bucket(bus).await?;
    put(&kv, &WeightManifest::key(&m.sha256), &m).await?;
    put(&kv, &format!("cache.{}", m.sha256.hex()), &m).await?;
    Ok(m)
}

/// Takes `m`'s file out of the in-cluster cache: its `cache.` entry first
/// (no load starts on it after that; one already reading falls back to
/// its other sources), then its chunks (those already gone, as after a
/// push that failed half way, are skipped). The manifest goes too unless
/// `keep_manifest` (nodes serve the file, and peers load it from them).
/// Answers the chunks deleted.
pub async fn remove(bus: &Bus, m: &WeightManifest, keep_manifest: bool) -> anyhow::Result<usize> {
    use async_nats::jetstream::object_store::DeleteErrorKind;
    let kv = bucket(bus).await?;
    let sha = m.sha256.hex();
    kv.purge(format!("cache.{sha}"))
        .await
        .map_err(|e| anyhow::anyhow!("removing cache.{sha}: {e}"))?;
    let store = bus.object_store(&bus.subjects.weights_objects()).await?;
    let mut deleted = 0;
    for i in 0..m.chunks.len() {
        let name = object(&m.sha256, i);
        match store.delete(name.as_str()).await {
            Ok(()) => deleted += 1,
            Err(e) if e.kind() == DeleteErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("deleting chunk {i} ({name}): {e}"),
        }
    }
    if !keep_manifest {
        let key = WeightManifest::key(&m.sha256);
        kv.purge(&key)
            .await
            .map_err(|e| anyhow::anyhow!("removing {key}: {e}"))?;
    }
    Ok(deleted)
}

/// A source that could not be opened, so the load's error names it.
pub(super) struct Unavailable {
    pub(super) name: String,
    pub(super) why: String,
}

impl ByteSource for Unavailable {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn size(&mut self) -> Result<u64, SourceError> {
        Err(SourceError::Gone(self.why.clone()))
    }
    fn read_at(&mut self, _: u64, _: &mut [u8]) -> Result<(), SourceError> {
        Err(SourceError::Gone(self.why.clone()))
    }
}

/// How long reading one chunk from the cache may take: a stalled object
/// store (a server lost mid-read) fails the read and the cache is given up
/// for the rest of the load, which goes on from other sources rather than
/// waiting for ever. 30 s plus the chunk at 10 MB/s.
fn chunk_read_timeout(bytes: usize) -> std::time::Duration {
    std::time::Duration::from_secs(30) + std::time::Duration::from_millis(bytes as u64 / 10_000)
}

/// Chunks read ahead of a loader that reads the cache in order: each
/// object's read begins with round trips to the server (a consumer per
/// object), which the reads ahead overlap. Bounds the memory held to this
/// many chunks.
const AHEAD: usize = 4;

/// The in-cluster cache as a loader's source.
///
/// Read in order (chunk `i` after `i - 1`, or chunk 0 first, as when the
/// cache is the first source), it keeps up to [`AHEAD`] chunks in flight;
/// read out of order (chunks other sources failed) it reads only what is
/// asked and stops what it read ahead. So at most `AHEAD - 1` chunks are
/// read that the load may not use (two failed chunks in a row from another
/// source look like order). Reads ahead are tasks this source owns: it
/// aborts them when dropped, when it skips past them, and when it gives
/// up after a stalled read.
pub(super) struct CacheSource {
    pub(super) store: async_nats::jetstream::object_store::ObjectStore,
    pub(super) manifest: WeightManifest,
    pub(super) cached: bool,
    pub(super) rt: tokio::runtime::Handle,
    /// Reads in flight, by chunk.
    pub(super) ahead: BTreeMap<usize, tokio::task::JoinHandle<Result<Vec<u8>, SourceError>>>,
    /// The chunk read last.
    pub(super) last: Option<usize>,
}

impl CacheSource {
    pub(super) fn new(
        store: async_nats::jetstream::object_store::ObjectStore,
        manifest: WeightManifest,
        cached: bool,
    ) -> Self {
        CacheSource {
            store,
            manifest,
            cached,
            rt: tokio::runtime::Handle::current(),
            ahead: BTreeMap::new(),
            last: None,
        }
    }

    /// Reads chunk `i` whole (at most one byte more, so a longer object
    /// is refused without reading it all).
    fn read(&self, i: usize) -> impl std::future::Future<Output = Result<Vec<u8>, SourceError>> {
        let name = object(&self.manifest.sha256, i);
        let store = self.store.clone();
        let want = self.manifest.chunk(i).1;
        async move {
            let o = store
                .get(name.as_str())
                .await
                .map_err(|e| SourceError::Io(format!("{name}: {e}")))?;
            let mut v = Vec::with_capacity(want);
            o.take(want as u64 + 1)
                .read_to_end(&mut v)
                .await
                .map_err(|e| SourceError::Io(format!("{name}: {e}")))?;
            Ok(v)
        }
    }
}

impl Drop for CacheSource {
    fn drop(&mut self) {
        for h in self.ahead.values() {
            h.abort();
        }
    }
}

impl ByteSource for CacheSource {
    fn name(&self) -> String {
        "cache (object store)".into()
    }
    fn size(&mut self) -> Result<u64, SourceError> {
        if self.cached {
            Ok(self.manifest.size)
        } else {
            Err(SourceError::Gone("does not hold this file".into()))
        }
    }
    fn read_at(&mut self, offset: u64, out: &mut [u8]) -> Result<(), SourceError> {
        let i = (offset / self.manifest.chunk_size) as usize;
        if i >= self.manifest.chunks.len() {
            return Err(SourceError::Io(format!(
                "offset {offset} is past the file's {} bytes",
                self.manifest.size
            )));
        }
        let in_order = self.last.map_or(i == 0, |l| l + 1 == i);
        self.last = Some(i);
        // Reads of chunks behind this one, or any but this one once the
        // order breaks, will not be asked for: they stop.
        self.ahead.retain(|&k, h| {
            let keep = k == i || (in_order && k > i);
            if !keep {
                h.abort();
            }
            keep
        });
        let upto = if in_order {
            (i + AHEAD).min(self.manifest.chunks.len())
        } else {
            i + 1
        };
        for k in i..upto {
            if !self.ahead.contains_key(&k) {
                let read = self.read(k);
                self.ahead.insert(k, self.rt.spawn(read));
            }
        }
        let Some(mut task) = self.ahead.remove(&i) else {
            return Err(SourceError::Io(format!("chunk {i} was not asked for")));
        };
        let limit = chunk_read_timeout(out.len());
        let waited = self
            .rt
            .block_on(async { tokio::time::timeout(limit, &mut task).await });
        let bytes = match waited {
            Ok(Ok(read)) => read?,
            Ok(Err(e)) => return Err(SourceError::Io(format!("chunk {i}: {e}"))),
            // A store that stalls on one chunk would stall on the next:
            // give the cache up, so the rest comes from other sources; the
            // stalled read and those ahead of it stop.
            Err(_) => {
                task.abort();
                for h in std::mem::take(&mut self.ahead).into_values() {
                    h.abort();
                }
                return Err(SourceError::Gone(format!(
                    "chunk {i} not read within {} s; the cache is given up for this load",
                    limit.as_secs()
                )));
            }
        };
        if bytes.len() != out.len() {
            return Err(SourceError::Io(format!(
                "chunk {i} has {} bytes, not {}",
                bytes.len(),
                out.len()
            )));
        }
        out.copy_from_slice(&bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded_nats::{EmbeddedNats, Security};
    use dynamo_bus_schema::{Namespace, Subjects};
    use dynamo_runtime::BusAccess;

    /// Against a real server: read in order, the cache keeps chunks in
    /// flight ahead of the loader; read out of order, only the chunk asked
    /// for; every chunk comes back byte for byte.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_cache_reads_ahead_only_in_order() {
        let nats = EmbeddedNats::start(0, Security::default()).await.unwrap();
        let subjects = Subjects::new(Namespace::new("cachetest").unwrap());
        let bus = Bus::connect(&nats.url, "test", subjects, &BusAccess::default())
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        // Seven chunks, the last one short.
        let file: Vec<u8> = (0..(6 * (4 << 20) + 1000))
            .map(|i: usize| (i.wrapping_mul(2654435761) >> 11) as u8)
            .collect();
        std::fs::write(&path, &file).unwrap();
        let m = push(&bus, &path, "m", &mut |_, _| {}).await.unwrap();
        assert_eq!(m.chunks.len(), 7);
        let store = bus
            .object_store(&bus.subjects.weights_objects())
            .await
            .unwrap();
        let mut src = CacheSource::new(store, m.clone(), true);
        tokio::task::spawn_blocking(move || {
            let mut read = |c: usize| {
                let (off, len) = m.chunk(c);
                let mut out = vec![0u8; len];
                src.read_at(off, &mut out).unwrap();
                assert!(out == file[off as usize..off as usize + len], "chunk {c}");
                src.ahead.keys().copied().collect::<Vec<_>>()
            };
            assert_eq!(read(0), [1, 2, 3]);
            assert_eq!(read(1), [2, 3, 4]);
            // Out of order (another source failed chunk 5): nothing ahead.
            assert_eq!(read(5), Vec::<usize>::new());
            // In order again, up to the end.
            assert_eq!(read(6), Vec::<usize>::new());
            // Chunk 0 again, after others: out of order.
            assert_eq!(read(0), Vec::<usize>::new());
            let mut out = vec![0u8; 10];
            let past = src
                .read_at(m.chunks.len() as u64 * m.chunk_size, &mut out)
                .unwrap_err();
            assert!(past.to_string().contains("past the file"), "{past}");
        })
        .await
        .unwrap();
    }
}
