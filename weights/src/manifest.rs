//! Manifests of weight files ([`Manifest`], the bus's
//! `WeightManifest`): computed from a file or bytes, and chunks checked
//! against them.

pub use dynamo_bus_schema::weights::{
    chunk_size_for, ContentHash, ManifestError, WeightManifest as Manifest, DEFAULT_CHUNK,
    MAX_CHUNK, MAX_CHUNKS, MIN_CHUNK,
};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// Reading a file for its manifest failed.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("reading {path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error(transparent)]
    Manifest(#[from] ManifestError),
}

/// The SHA-256 of `bytes`.
pub fn hash(bytes: &[u8]) -> ContentHash {
    ContentHash(Sha256::digest(bytes).into())
}

/// Whether `bytes` are chunk `i` of `m`.
pub fn chunk_ok(m: &Manifest, i: usize, bytes: &[u8]) -> bool {
    m.chunks.get(i) == Some(&hash(bytes))
}

/// The manifest of a file, read once.
pub fn of_file(path: &Path, model: &str, layout: &str) -> Result<Manifest, FileError> {
    let io = |source| FileError::Io {
        path: path.display().to_string(),
        cause: source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let size = f.metadata().map_err(io)?.len();
    let chunk_size = chunk_size_for(size);
    let mut chunks = Vec::new();
    // The whole file is hashed on a second thread while this one reads
    // and hashes chunks; buffers go round between the two (bounded: two
    // in flight).
    let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<(Vec<u8>, usize)>(2);
    let (free_tx, free_rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(3);
    let buf_len = chunk_size.min(size.max(1)) as usize;
    for _ in 0..3 {
        let _ = free_tx.send(vec![0u8; buf_len]);
    }
    let whole = std::thread::scope(|sc| {
        let hasher = sc.spawn(move || {
            let mut whole = Sha256::new();
            for (buf, n) in full_rx {
                whole.update(&buf[..n]);
                let _ = free_tx.send(buf);
            }
            whole.finalize()
        });
        let mut left = size;
        let read = (|| {
            while left > 0 {
                let n = left.min(chunk_size) as usize;
                let mut buf = free_rx.recv().unwrap_or_else(|_| vec![0u8; buf_len]);
                f.read_exact(&mut buf[..n]).map_err(io)?;
                chunks.push(hash(&buf[..n]));
                if full_tx.send((buf, n)).is_err() {
                    break;
                }
                left -= n as u64;
            }
            Ok::<_, FileError>(())
        })();
        drop(full_tx);
        let whole = hasher.join();
        read?;
        whole.map_err(|_| FileError::Io {
            path: path.display().to_string(),
            cause: std::io::Error::other("the hashing thread failed"),
        })
    })?;
    let m = Manifest {
        model: model.to_string(),
        sha256: ContentHash(whole.into()),
        layout: layout.to_string(),
        size,
        chunk_size,
        chunks,
    };
    m.validate()?;
    Ok(m)
}

/// The manifest of `path` as `model` in `layout`: from the manifest cache when it
/// holds one for this path, size and modification time, else computed
/// (hashing the whole file) and kept there, so a file is hashed once per
/// machine, not at every start.
pub fn of_file_cached(
    dir: &Path,
    path: &Path,
    model: &str,
    layout: &str,
) -> Result<Manifest, FileError> {
    let (file, len) = cache_entry(dir, path, model, layout)?;
    if let Ok(bytes) = std::fs::read(&file) {
        match serde_json::from_slice::<Manifest>(&bytes) {
            Ok(m)
                if m.size == len
                    && m.model == model
                    && m.layout == layout
                    && m.validate().is_ok() =>
            {
                return Ok(m)
            }
            _ => {
                tracing::warn!(file = %file.display(), "weights: a cached manifest is unreadable; hashing again")
            }
        }
    }
    let m = of_file(path, model, layout)?;
    keep(&file, &m);
    Ok(m)
}

/// The manifest of `bytes`, read from `path` while it had metadata `meta`:
/// from the manifest cache when it holds one for that path, size and
/// modification time, else computed from the bytes (not the file, which
/// may have changed since) and kept.
pub fn of_bytes_cached(
    dir: &Path,
    path: &Path,
    meta: &std::fs::Metadata,
    bytes: &[u8],
    model: &str,
    layout: &str,
) -> Result<Manifest, FileError> {
    let (file, len) = cache_entry_for(dir, path, meta, model, layout)?;
    if let Ok(cached) = std::fs::read(&file) {
        if let Ok(m) = serde_json::from_slice::<Manifest>(&cached) {
            if m.size == len
                && len == bytes.len() as u64
                && m.model == model
                && m.layout == layout
                && m.validate().is_ok()
            {
                return Ok(m);
            }
        }
    }
    let m = of_bytes(bytes, model, layout);
    if len == bytes.len() as u64 {
        keep(&file, &m);
    }
    Ok(m)
}

/// Records `m` as the manifest of `path` in the manifest cache `dir`,
/// for a file whose every byte was just verified against `m` (a load's
/// output), so it is not hashed again at the next start.
pub fn remember(dir: &Path, path: &Path, m: &Manifest) -> Result<(), FileError> {
    let (file, len) = cache_entry(dir, path, &m.model, &m.layout)?;
    if len != m.size {
        return Err(FileError::Io {
            path: path.display().to_string(),
            cause: std::io::Error::other(format!("holds {len} bytes, not {}", m.size)),
        });
    }
    keep(&file, m);
    Ok(())
}

/// The cache entry of `path` (named by its canonical path, size,
/// modification time, model and layout) and the file's size.
fn cache_entry(
    dir: &Path,
    path: &Path,
    model: &str,
    layout: &str,
) -> Result<(std::path::PathBuf, u64), FileError> {
    let meta = std::fs::metadata(path).map_err(|source| FileError::Io {
        path: path.display().to_string(),
        cause: source,
    })?;
    cache_entry_for(dir, path, &meta, model, layout)
}

/// [`cache_entry`] for the file as it was when it had metadata `meta`.
fn cache_entry_for(
    dir: &Path,
    path: &Path,
    meta: &std::fs::Metadata,
    model: &str,
    layout: &str,
) -> Result<(std::path::PathBuf, u64), FileError> {
    let io = |source| FileError::Io {
        path: path.display().to_string(),
        cause: source,
    };
    let mtime = meta
        .modified()
        .map_err(io)?
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let key = hash(
        format!(
            "{}\n{}\n{mtime}\n{model}\n{layout}",
            canonical.display(),
            meta.len()
        )
        .as_bytes(),
    );
    Ok((dir.join(format!("{}.json", key.hex())), meta.len()))
}

/// Best effort: a cache that cannot be written costs a hash next time.
fn keep(file: &Path, m: &Manifest) {
    let tmp = file.with_extension(format!("{}.part", std::process::id()));
    let wrote = std::fs::create_dir_all(file.parent().unwrap_or(Path::new(".")))
        .and_then(|_| std::fs::write(&tmp, serde_json::to_vec(m).unwrap_or_default()))
        .and_then(|_| std::fs::rename(&tmp, file));
    if let Err(e) = wrote {
        tracing::debug!(error = %e, "weights: manifest not cached");
    }
}

/// The manifest of bytes in memory.
pub fn of_bytes(bytes: &[u8], model: &str, layout: &str) -> Manifest {
    let chunk_size = chunk_size_for(bytes.len() as u64);
    Manifest {
        model: model.to_string(),
        sha256: hash(bytes),
        layout: layout.to_string(),
        size: bytes.len() as u64,
        chunk_size,
        chunks: bytes.chunks(chunk_size as usize).map(hash).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn bytes_read_from_a_file_get_the_manifest_of_what_was_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let (a, b) = (
            bytes(5 << 20),
            bytes(5 << 20).iter().map(|x| !x).collect::<Vec<_>>(),
        );
        std::fs::write(&path, &a).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        let cache = dir.path().join("cache");
        // Computed from the bytes given, then found in the cache.
        let m = of_bytes_cached(&cache, &path, &meta, &a, "m", "gguf").unwrap();
        assert_eq!(m, of_bytes(&a, "m", "gguf"));
        assert_eq!(of_file_cached(&cache, &path, "m", "gguf").unwrap(), m);
        // The file rewritten since: bytes read under the new metadata get
        // their own manifest, never the old file's.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        (&f).write_all(&b).unwrap();
        f.set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(7))
            .unwrap();
        let meta2 = std::fs::metadata(&path).unwrap();
        let m2 = of_bytes_cached(&cache, &path, &meta2, &b, "m", "gguf").unwrap();
        assert_eq!(m2, of_bytes(&b, "m", "gguf"));
        assert_ne!(m2.sha256, m.sha256);
    }

    #[test]
    fn a_file_and_its_bytes_give_one_manifest() {
        let b = bytes(9 << 20);
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&b).unwrap();
        let m = of_file(f.path(), "m", "gguf").unwrap();
        assert_eq!(m, of_bytes(&b, "m", "gguf"));
        assert_eq!((m.chunk_size, m.chunks.len()), (DEFAULT_CHUNK, 3));
        assert_eq!(m.chunk(2), (8 << 20, 1 << 20));
        assert!(chunk_ok(&m, 2, &b[8 << 20..]));
        assert!(!chunk_ok(&m, 1, &b[8 << 20..]));
        assert_eq!(m.sha256, hash(&b));
        let j = serde_json::to_string(&m).unwrap();
        assert!(j.contains(&m.sha256.hex()));
        assert_eq!(serde_json::from_str::<Manifest>(&j).unwrap(), m);
    }

    #[test]
    fn a_cached_manifest_is_the_files_own() {
        let b = bytes(2 << 20);
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&b).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let first = of_file_cached(dir.path(), f.path(), "m", "gguf").unwrap();
        assert_eq!(first, of_bytes(&b, "m", "gguf"));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert_eq!(
            of_file_cached(dir.path(), f.path(), "m", "gguf").unwrap(),
            first
        );
    }

    #[test]
    fn a_remembered_manifest_is_answered_without_hashing_again() {
        let b = bytes(2 << 20);
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&b).unwrap();
        let dir = tempfile::tempdir().unwrap();
        // What a load verified is taken as is: a marker hash shows that
        // the file was not read again.
        let mut m = of_bytes(&b, "m", "gguf");
        m.sha256 = ContentHash([7; 32]);
        remember(dir.path(), f.path(), &m).unwrap();
        assert_eq!(
            of_file_cached(dir.path(), f.path(), "m", "gguf").unwrap(),
            m
        );
        // A manifest of another size is not this file's.
        let other = of_bytes(&b[..1 << 20], "m", "gguf");
        let e = remember(dir.path(), f.path(), &other)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not 1048576"), "{e}");
    }

    #[test]
    fn large_files_get_larger_chunks_and_bad_manifests_are_refused() {
        assert_eq!(chunk_size_for(0), DEFAULT_CHUNK);
        let big = 64u64 << 30;
        let c = chunk_size_for(big);
        assert!(big.div_ceil(c) <= MAX_CHUNKS as u64 && c > DEFAULT_CHUNK);
        let mut m = of_bytes(&bytes(5 << 20), "m", "gguf");
        m.validate().unwrap();
        m.chunks.pop();
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains("`chunks`"), "{e}");
        m.chunk_size = 10;
        assert!(m.validate().unwrap_err().to_string().contains("chunk_size"));
        assert!(ContentHash::parse("xyz").is_err());
        assert!(serde_json::from_str::<ContentHash>("\"00\"").is_err());
    }
}
