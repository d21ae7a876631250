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

/// The in-cluster cache as a loader's source.
pub(super) struct CacheSource {
    pub(super) store: async_nats::jetstream::object_store::ObjectStore,
    pub(super) manifest: WeightManifest,
    pub(super) cached: bool,
    pub(super) rt: tokio::runtime::Handle,
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
        let name = object(&self.manifest.sha256, i);
        let store = self.store.clone();
        let want = out.len();
        let limit = chunk_read_timeout(want);
        let read = async move {
            let o = store
                .get(name.as_str())
                .await
                .map_err(|e| SourceError::Io(format!("{name}: {e}")))?;
            // At most one byte more than the chunk: a longer object is
            // refused below without reading it all.
            let mut v = Vec::with_capacity(want);
            o.take(want as u64 + 1)
                .read_to_end(&mut v)
                .await
                .map_err(|e| SourceError::Io(format!("{name}: {e}")))?;
            Ok::<_, SourceError>(v)
        };
        let bytes = self
            .rt
            .block_on(async move { tokio::time::timeout(limit, read).await })
            // A store that stalls on one chunk would stall on the next:
            // give the cache up, so the rest comes from other sources.
            .map_err(|_| {
                SourceError::Gone(format!(
                    "chunk {i} not read within {} s; the cache is given up for this load",
                    limit.as_secs()
                ))
            })??;
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
