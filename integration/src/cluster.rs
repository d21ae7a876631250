//! Clusters of joined nodes ([`JoinedCluster`]) and what `dynamoctl` says
//! of their deployments and planner.

use super::*;

/// `dynamoctl describe deployment NAME --json`, parsed.
pub fn describe_deployment(nats_url: &str, name: &str) -> Value {
    let out = dynamoctl(nats_url, &["describe", "deployment", name, "--json"]);
    assert_success(&out);
    serde_json::from_slice(&out.stdout).expect("describe prints JSON")
}

/// Waits until `cond` holds for the deployment's description; panics with
/// the last description after `within`.
pub async fn wait_deployment(
    nats_url: &str,
    name: &str,
    within: Duration,
    what: &str,
    cond: impl Fn(&Value) -> bool,
) -> Value {
    let t0 = Instant::now();
    loop {
        let d = describe_deployment(nats_url, name);
        if cond(&d) {
            return d;
        }
        assert!(
            t0.elapsed() < within,
            "{what}: not within {within:?}:\n{}",
            serde_json::to_string_pretty(&d).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A service's entry in a description (null until the controller reports it).
pub fn service<'a>(d: &'a Value, name: &str) -> &'a Value {
    static NULL: Value = Value::Null;
    d["services"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["name"] == name))
        .unwrap_or(&NULL)
}

/// `replica -> node` for a service in a description.
pub fn placements(d: &Value, name: &str) -> std::collections::BTreeMap<String, String> {
    service(d, name)["placements"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            (
                p["replica"].as_str().unwrap_or_default().to_string(),
                p["node"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// One node of a [`JoinedCluster`].
pub struct JoinSpec {
    pub id: String,
    /// `--labels` (e.g. `zone=z1,rack=r1,host=h1`).
    pub labels: String,
    pub slots: u32,
    /// `--roles` (e.g. `controller`), empty for none.
    pub roles: String,
    /// Further `dynamo-node` arguments.
    pub extra: Vec<String>,
}

impl JoinSpec {
    pub fn new(id: &str, labels: &str, slots: u32, roles: &str) -> Self {
        JoinSpec {
            id: id.into(),
            labels: labels.into(),
            slots,
            roles: roles.into(),
            extra: Vec::new(),
        }
    }

    /// With further `dynamo-node` arguments.
    pub fn with_args(mut self, args: &[&str]) -> Self {
        self.extra.extend(args.iter().map(|a| a.to_string()));
        self
    }
}

/// Node daemons joined to one real NATS, each with an HTTP port for a
/// frontend placed there; built only once every node is in the inventory.
pub struct JoinedCluster {
    pub nats: Nats,
    pub nodes: std::collections::BTreeMap<String, Node>,
    pub ports: std::collections::BTreeMap<String, u16>,
    /// Each node's own metrics listener (`--metrics-listen`).
    pub metrics_ports: std::collections::BTreeMap<String, u16>,
    pub dir: tempfile::TempDir,
}

impl JoinedCluster {
    pub fn start(specs: &[JoinSpec]) -> JoinedCluster {
        let nats = Nats::start();
        let mut nodes = std::collections::BTreeMap::new();
        let mut ports = std::collections::BTreeMap::new();
        let mut metrics_ports = std::collections::BTreeMap::new();
        for s in specs {
            let port = free_port();
            let listen = format!("127.0.0.1:{port}");
            let metrics_port = free_port();
            let metrics = format!("127.0.0.1:{metrics_port}");
            let slots = s.slots.to_string();
            let mut args = vec![
                "--node-id",
                s.id.as_str(),
                "--labels",
                s.labels.as_str(),
                "--slots",
                slots.as_str(),
                "--http-listen",
                listen.as_str(),
                "--metrics-listen",
                metrics.as_str(),
            ];
            if !s.roles.is_empty() {
                args.extend(["--roles", s.roles.as_str()]);
            }
            args.extend(s.extra.iter().map(String::as_str));
            nodes.insert(s.id.clone(), Node::join(&nats.url, &args));
            ports.insert(s.id.clone(), port);
            metrics_ports.insert(s.id.clone(), metrics_port);
        }
        let t0 = Instant::now();
        loop {
            let out = dynamoctl(&nats.url, &["status", "--json"]);
            let joined = serde_json::from_slice::<Value>(&out.stdout)
                .ok()
                .and_then(|v| {
                    v["nodes"]
                        .as_array()
                        .map(|a| a.iter().filter(|n| n["slots"].is_u64()).count())
                })
                .unwrap_or(0);
            if joined == specs.len() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{joined}/{} nodes joined; dynamoctl status: {} {}",
                specs.len(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        JoinedCluster {
            nats,
            nodes,
            ports,
            metrics_ports,
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    /// `dynamoctl ARGS…` against this cluster.
    pub fn ctl(&self, args: &[&str]) -> std::process::Output {
        dynamoctl(&self.nats.url, args)
    }

    /// Writes `text` to a file in the cluster's directory; its path.
    pub fn write(&self, name: &str, text: &str) -> String {
        let p = self.dir.path().join(name);
        std::fs::write(&p, text).expect("write file");
        p.display().to_string()
    }

    /// The HTTP port of the node running `service`'s first replica.
    pub fn port_of(&self, d: &Value, service: &str) -> u16 {
        let node = placements(d, service)
            .into_values()
            .next()
            .unwrap_or_else(|| panic!("{service} is not placed: {d}"));
        self.ports[&node]
    }
}

/// `dynamoctl planner status DEPLOYMENT --json`: the deployment's entry.
pub fn planner_status(nats_url: &str, deployment: &str) -> Value {
    let out = dynamoctl(nats_url, &["planner", "status", deployment, "--json"]);
    assert_success(&out);
    let v: Value = serde_json::from_slice(&out.stdout).expect("planner status prints JSON");
    v[0].clone()
}
