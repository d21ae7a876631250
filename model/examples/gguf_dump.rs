//! Prints a GGUF file's metadata keys (arrays summarised): `cargo run -p dynamo-model --example gguf_dump -- FILE`.
use dynamo_model::gguf::{GgufMetadata, Value};

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: gguf_dump FILE.gguf");
        std::process::exit(2);
    };
    match GgufMetadata::open(std::path::Path::new(&path)) {
        Ok(m) => {
            println!("version {} tensors {}", m.version, m.tensor_count);
            for (k, v) in &m.kv {
                match v {
                    Value::Array(a) => println!(
                        "{k} = [{} items] first: {:?}",
                        a.len(),
                        &a[..a.len().min(3)]
                    ),
                    Value::String(s) if s.len() > 200 => println!("{k} = {:?}…", &s[..200]),
                    other => println!("{k} = {other:?}"),
                }
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
