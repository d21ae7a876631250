//! The pyzmq publisher the ZMQ tests run against (`zmq_publisher.py`).

use dynamo_external_engine::zmq_source::ZmqConfig;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The publisher script, once it is listening, and its two ports.
pub fn publisher() -> (std::process::Child, u16, u16) {
    let dir = env!("CARGO_MANIFEST_DIR");
    let mut child = Command::new("python3")
        .arg(format!("{dir}/tests/zmq_publisher.py"))
        .arg(format!("{dir}/tests/fixtures"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        words.first(),
        Some(&"ready"),
        "the publisher needs pyzmq (`make deps` installs it)"
    );
    let port = |i: usize| words[i].parse::<u16>().expect("a port");
    (child, port(1), port(2))
}

pub fn config(pub_port: u16, replay_port: u16) -> ZmqConfig {
    ZmqConfig {
        endpoint: format!("tcp://127.0.0.1:{pub_port}"),
        replay_endpoint: Some(format!("tcp://127.0.0.1:{replay_port}")),
        topic: "kv".into(),
        dp_rank: 0,
        replay_timeout: Duration::from_secs(5),
    }
}
