//! `dynamoctl index query`: what each worker holds of a prompt, as the
//! gateway's router sees it (`POST /v1/dynamo/overlap`).

use serde_json::{json, Value};

#[derive(clap::Subcommand, Debug)]
pub enum IndexCmd {
    /// Per worker: the prompt's leading blocks it holds, by tier.
    Query {
        /// The gateway.
        #[arg(long, default_value = "http://127.0.0.1:8000")]
        url: String,
        #[arg(long, default_value = dynamo_model::DEFAULT_MODEL_NAME)]
        model: String,
        /// Text, tokenized as `/v1/completions` tokenizes a string prompt.
        #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
        text: Option<String>,
        /// Token ids, comma-separated.
        #[arg(long, value_delimiter = ',')]
        tokens: Option<Vec<u32>>,
        /// The gateway's API key, if it has keys.
        #[arg(long, env = "DYNAMO_API_KEY")]
        api_key: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

/// Runs `index query`.
pub async fn run(cmd: IndexCmd) -> anyhow::Result<()> {
    let IndexCmd::Query {
        url,
        model,
        text,
        tokens,
        api_key,
        json: json_out,
    } = cmd;
    let prompt = match (text, tokens) {
        (Some(t), _) => json!(t),
        (None, Some(t)) => json!(t),
        (None, None) => anyhow::bail!("give --text or --tokens"),
    };
    crate::bench::check_url(&url)?;
    let endpoint = format!("{}/v1/dynamo/overlap", url.trim_end_matches('/'));
    let mut req = reqwest::Client::new()
        .post(&endpoint)
        .timeout(std::time::Duration::from_secs(15))
        .json(&json!({"model": model, "prompt": prompt}));
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let r = req
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the gateway at {url}: {e}"))?;
    let status = r.status();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        let msg = v["error"]["message"].as_str().unwrap_or("no error message");
        anyhow::bail!("the gateway answered {status}: {msg}");
    }
    if json_out {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("prompt: {} tokens", v["tokens"]);
    let rows: Vec<Value> = v["workers"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(w, o)| {
                    json!({"worker": w, "blocks": o["blocks"], "device": o["device"], "host": o["host"], "disk": o["disk"]})
                })
                .collect()
        })
        .unwrap_or_default();
    if rows.is_empty() {
        println!("no worker holds its first block");
    } else {
        print!(
            "{}",
            crate::js_cli::table(&rows, &["worker", "blocks", "device", "host", "disk"])
        );
    }
    Ok(())
}
