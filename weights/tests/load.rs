//! Loads over real libfabric endpoints (`tcp;ofi_rxm` and `shm`) from
//! peers serving registered memory, and from files.

use dynamo_weights::source::{ByteSource, FileSource};
use dynamo_weights::{load, LoadError, LoadOptions, Source, WeightServer};
use std::io::Write;
use std::time::Duration;

fn content(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| ((i as u64 * 2654435761) >> 13) as u8 ^ seed)
        .collect()
}

fn file(bytes: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(bytes).unwrap();
    f.flush().unwrap();
    f
}

fn opts(provider: &str) -> LoadOptions {
    LoadOptions {
        provider: provider.into(),
        window: 4,
        peer_timeout: Duration::from_secs(5),
        max_bytes_per_sec: None,
    }
}

fn peer(s: &WeightServer, name: &str) -> Source {
    Source::Peer(s.descriptor().source(name).expect("hex address"))
}

fn from_peers(provider: &str) {
    let b = content(19 << 20, 1);
    let f = file(&b);
    let m = dynamo_weights::manifest::of_file(f.path(), "m", "gguf").unwrap();
    let a = WeightServer::from_file(f.path(), m.clone(), provider).unwrap();
    let c = WeightServer::from_file(f.path(), m.clone(), provider).unwrap();
    let mut seen = Vec::new();
    let got = load(
        &m,
        vec![
            peer(&a, "a"),
            peer(&c, "c"),
            Source::Bytes(Box::new(FileSource::new(f.path()))),
        ],
        &opts(provider),
        None,
        &mut |p| seen.push(p.clone()),
    )
    .unwrap();
    assert!(got.bytes() == &b[..]);
    // Both peers gave chunks; the file was not needed.
    let by: Vec<u64> = got.by_source.iter().map(|(_, n)| *n).collect();
    assert!(by[0] > 0 && by[1] > 0 && by[2] == 0, "{:?}", got.by_source);
    assert_eq!(by.iter().sum::<u64>(), b.len() as u64);
    assert_eq!(
        seen.last().map(|p| (p.done, p.total)),
        Some((b.len() as u64, b.len() as u64))
    );
    assert_eq!(got.refetched, 0);
    // The loaded memory is registered and can be served on in turn, while
    // an engine keeps the same bytes: one copy, shared.
    let at = got.bytes().as_ptr();
    let shared = got.into_shared().unwrap();
    let kept = shared.bytes().clone();
    assert!(kept == b[..]);
    assert_eq!(kept.as_ptr(), at);
    let (agent, region, m2) = shared.into_registered().expect("registered");
    assert_eq!(region.bytes().as_ptr(), kept.as_ptr());
    let next = WeightServer::shared(agent, region, m2).unwrap();
    assert_eq!(next.bytes().as_ptr(), kept.as_ptr());
    let again = load(
        &m,
        vec![peer(&next, "next")],
        &opts(provider),
        None,
        &mut |_| {},
    )
    .unwrap();
    assert!(again.bytes() == &b[..]);
    // The bytes outlive the server that shared them.
    next.stop().unwrap();
    assert!(kept == b[..]);
}

#[test]
fn a_load_from_a_file_alone_is_shared_but_not_registered() {
    let b = content(5 << 20, 7);
    let f = file(&b);
    let m = dynamo_weights::manifest::of_file(f.path(), "m", "gguf").unwrap();
    let got = load(
        &m,
        vec![Source::Bytes(Box::new(FileSource::new(f.path())))],
        &opts("tcp;ofi_rxm"),
        None,
        &mut |_| {},
    )
    .unwrap();
    let at = got.bytes().as_ptr();
    let shared = got.into_shared().unwrap();
    let kept = shared.bytes().clone();
    assert_eq!(kept.as_ptr(), at, "shared, not copied");
    assert_eq!(kept.len(), b.len());
    assert!(kept == b[..]);
    assert!(shared.into_registered().is_none());
    assert!(kept == b[..]);
}

#[test]
fn tcp_rxm_peers_give_the_file_byte_for_byte() {
    from_peers("tcp;ofi_rxm");
}

#[test]
fn shm_peers_give_the_file_byte_for_byte() {
    from_peers("shm");
}

#[test]
fn a_corrupted_chunk_is_fetched_again_from_another_source() {
    let provider = "tcp;ofi_rxm";
    let b = content(13 << 20, 2);
    let f = file(&b);
    let m = dynamo_weights::manifest::of_file(f.path(), "m", "gguf").unwrap();
    // A peer whose memory has one byte wrong in chunk 1.
    let mut bad = b.clone();
    bad[(5 << 20) + 7] ^= 0xff;
    let fb = file(&bad);
    let mut agent = dynamo_transfer::Agent::new(provider).unwrap();
    let mut region = agent.register(bad.len()).unwrap();
    region.bytes_mut().copy_from_slice(&bad);
    let liar = WeightServer::new(agent, region, m.clone()).unwrap();
    let got = load(
        &m,
        vec![
            peer(&liar, "liar"),
            Source::Bytes(Box::new(FileSource::new(f.path()))),
        ],
        &opts(provider),
        None,
        &mut |_| {},
    )
    .unwrap();
    assert!(got.bytes() == &b[..]);
    assert_eq!(got.refetched, 1);
    assert_eq!(
        got.by_source[1].1,
        m.chunk(1).1 as u64,
        "{:?}",
        got.by_source
    );
    // The file's hash found the fault, each chunk's hash placed it: only
    // the wrong chunk was fetched again, and the liar's others were kept.
    assert_eq!(
        got.by_source[0].1,
        m.size - m.chunk(1).1 as u64,
        "{:?}",
        got.by_source
    );
    // A file of the right size but other bytes is refused, chunk by chunk.
    let e = load(
        &m,
        vec![Source::Bytes(Box::new(FileSource::new(fb.path())))],
        &opts(provider),
        None,
        &mut |_| {},
    )
    .err()
    .expect("refused");
    let s = e.to_string();
    assert!(
        s.contains("does not match its SHA-256") && s.contains("chunk 1"),
        "{s}"
    );
    // A manifest whose chunks are right but whose content hash is not.
    let mut lie = m.clone();
    lie.sha256 = dynamo_weights::manifest::hash(b"other");
    let e = load(
        &lie,
        vec![Source::Bytes(Box::new(FileSource::new(f.path())))],
        &opts(provider),
        None,
        &mut |_| {},
    )
    .err()
    .expect("refused");
    assert!(matches!(e, LoadError::Mismatch { .. }), "{e}");
}

#[test]
fn a_peer_that_goes_away_mid_load_is_replaced_by_the_next_source() {
    let provider = "tcp;ofi_rxm";
    let b = content(33 << 20, 3);
    let f = file(&b);
    let m = dynamo_weights::manifest::of_file(f.path(), "m", "gguf").unwrap();
    let gone = WeightServer::from_file(f.path(), m.clone(), provider).unwrap();
    let src = vec![
        peer(&gone, "gone"),
        Source::Bytes(Box::new(FileSource::new(f.path()))),
    ];
    let mut gone = Some(gone);
    let mut opts = opts(provider);
    opts.window = 2;
    opts.peer_timeout = Duration::from_secs(2);
    let got = load(&m, src, &opts, None, &mut |p| {
        // After the first chunks, the peer's endpoint closes.
        if p.done >= 2 * m.chunk_size {
            if let Some(g) = gone.take() {
                g.stop().unwrap();
            }
        }
    })
    .unwrap();
    assert!(got.bytes() == &b[..]);
    let (peer_bytes, file_bytes) = (got.by_source[0].1, got.by_source[1].1);
    assert!(
        peer_bytes >= 2 * m.chunk_size && file_bytes > 0,
        "{:?}",
        got.by_source
    );
}

/// A source that is there but has nothing (the object store without it).
struct Empty;
impl ByteSource for Empty {
    fn name(&self) -> String {
        "object store weights".into()
    }
    fn size(&mut self) -> Result<u64, dynamo_weights::SourceError> {
        Err(dynamo_weights::SourceError::Gone(
            "no object for this sha256".into(),
        ))
    }
    fn read_at(&mut self, _: u64, _: &mut [u8]) -> Result<(), dynamo_weights::SourceError> {
        unreachable!("a source without the file is not read")
    }
}

#[test]
fn with_no_source_the_error_names_each_one_tried() {
    let b = content(3 << 20, 4);
    let m = dynamo_weights::manifest::of_bytes(&b, "smollm2", "gguf");
    let e = load(
        &m,
        vec![
            Source::Bytes(Box::new(Empty)),
            Source::Bytes(Box::new(FileSource::new("/nonexistent/model.gguf"))),
        ],
        &opts("tcp;ofi_rxm"),
        None,
        &mut |_| {},
    )
    .err()
    .expect("no source");
    let s = e.to_string();
    for want in [
        "smollm2",
        "object store weights: no object",
        "file /nonexistent/model.gguf: cannot open",
    ] {
        assert!(s.contains(want), "{want:?} not in {s}");
    }
    let e = load(&m, vec![], &opts("tcp;ofi_rxm"), None, &mut |_| {})
        .err()
        .unwrap();
    assert!(e.to_string().contains("no source was configured"), "{e}");
    // A manifest whose chunks do not cover its size (as off the bus) is an
    // error, not a panic.
    let mut bad = m.clone();
    bad.size = 1 << 40;
    let e = load(&bad, vec![], &opts("tcp;ofi_rxm"), None, &mut |_| {})
        .err()
        .unwrap();
    assert!(matches!(e, LoadError::Manifest(_)), "{e}");
}

#[test]
fn registered_memory_is_reused_by_the_next_load() {
    let provider = "tcp;ofi_rxm";
    let b = content(6 << 20, 5);
    let f = file(&b);
    let m = dynamo_weights::manifest::of_file(f.path(), "m", "gguf").unwrap();
    let s = WeightServer::from_file(f.path(), m.clone(), provider).unwrap();
    let first = load(&m, vec![peer(&s, "s")], &opts(provider), None, &mut |_| {}).unwrap();
    let at = first.bytes().as_ptr();
    let (agent, region, _) = first.into_registered().ok().unwrap();
    let second = load(
        &m,
        vec![peer(&s, "s")],
        &opts(provider),
        Some((agent, region)),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(second.bytes().as_ptr(), at);
    assert!(second.bytes() == &b[..]);
}
