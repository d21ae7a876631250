//! A real three-server NATS cluster with JetStream for HA tests: each
//! server has its own port, cluster port, monitoring port and store, with
//! routes to the others. Killed on drop.

use crate::free_port;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server {
    child: Option<Child>,
    port: u16,
    monitor: u16,
}

pub struct NatsCluster {
    servers: Vec<Server>,
    _dir: tempfile::TempDir,
}

impl NatsCluster {
    /// Starts `n` clustered servers and waits until JetStream can place an
    /// R`n` stream (its meta leader is elected).
    pub async fn start(n: usize) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let ports: Vec<(u16, u16, u16)> = (0..n)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect();
        let mut servers = Vec::new();
        for (i, &(port, cport, monitor)) in ports.iter().enumerate() {
            let routes: Vec<String> = ports
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, p)| format!("\"nats-route://127.0.0.1:{}\"", p.1))
                .collect();
            let store = dir.path().join(format!("n{i}"));
            let conf = format!(
                "server_name: n{i}\nlisten: \"127.0.0.1:{port}\"\nhttp: \"127.0.0.1:{monitor}\"\n\
                 jetstream {{ store_dir: \"{}\" }}\n\
                 cluster {{ name: dyn, listen: \"127.0.0.1:{cport}\", routes: [{}] }}\n",
                store.display(),
                routes.join(", ")
            );
            let path = dir.path().join(format!("n{i}.conf"));
            std::fs::write(&path, conf).expect("write nats config");
            let child = Command::new("nats-server")
                .arg("-c")
                .arg(&path)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("nats-server installed (make deps)");
            servers.push(Server {
                child: Some(child),
                port,
                monitor,
            });
        }
        let c = NatsCluster { servers, _dir: dir };
        c.wait_jetstream(n).await;
        c
    }

    async fn wait_jetstream(&self, replicas: usize) {
        let t0 = Instant::now();
        loop {
            let ready = async {
                let servers = dynamo_runtime::bus::server_addrs(&self.urls()).ok()?;
                let client = async_nats::connect(servers).await.ok()?;
                let js = async_nats::jetstream::new(client);
                let cfg = async_nats::jetstream::stream::Config {
                    name: "READY".into(),
                    subjects: vec!["ready.check".into()],
                    num_replicas: replicas,
                    storage: async_nats::jetstream::stream::StorageType::Memory,
                    ..Default::default()
                };
                js.create_stream(cfg).await.ok()?;
                js.delete_stream("READY").await.ok()?;
                Some(())
            };
            if tokio::time::timeout(Duration::from_secs(5), ready)
                .await
                .ok()
                .flatten()
                .is_some()
            {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the NATS cluster did not elect a JetStream leader in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Every server's URL, comma-separated (what a node is given).
    pub fn urls(&self) -> String {
        self.servers
            .iter()
            .map(|s| format!("nats://127.0.0.1:{}", s.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Server `i`'s own URL.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.servers[i].port)
    }

    /// Client connections on server `i` (its monitoring endpoint); 0 when it is down.
    pub async fn connections(&self, i: usize) -> u64 {
        let url = format!("http://127.0.0.1:{}/connz", self.servers[i].monitor);
        match reqwest::get(url).await {
            Ok(r) => r
                .json::<serde_json::Value>()
                .await
                .ok()
                .and_then(|v| v["num_connections"].as_u64())
                .unwrap_or(0),
            Err(_) => 0,
        }
    }

    /// The server with the most client connections.
    pub async fn busiest(&self) -> usize {
        let mut best = (0, 0);
        for i in 0..self.servers.len() {
            let n = self.connections(i).await;
            if n > best.1 {
                best = (i, n);
            }
        }
        best.0
    }

    /// The server leading `stream` (servers are named `n<i>`), asked
    /// through the first live server that answers.
    pub async fn leader_of(&self, stream: &str) -> Option<usize> {
        for i in 0..self.servers.len() {
            if self.servers[i].child.is_none() {
                continue;
            }
            let ask = async {
                let c = async_nats::connect(self.url(i)).await.ok()?;
                let mut s = async_nats::jetstream::new(c)
                    .get_stream(stream)
                    .await
                    .ok()?;
                let leader = s.info().await.ok()?.cluster.as_ref()?.leader.clone()?;
                leader.strip_prefix('n')?.parse::<usize>().ok()
            };
            if let Ok(Some(l)) = tokio::time::timeout(std::time::Duration::from_secs(5), ask).await
            {
                return Some(l);
            }
        }
        None
    }

    /// Kills server `i` (SIGKILL: no goodbye to clients or peers).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.servers[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.servers.len() {
            self.kill(i);
        }
    }
}
