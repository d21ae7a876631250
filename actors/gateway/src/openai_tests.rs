//! Tests of `openai.rs`: parsing, field names in errors, and options.

use super::*;

#[test]
fn serde_errors_name_the_field() {
    let e = parse_body::<ChatRequest>(br#"{"messages": []}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("model"));
    let e = parse_body::<ChatRequest>(b"{not json").unwrap_err();
    assert!(e.message.contains("could not parse the JSON"));
    let e = parse_body::<ChatRequest>(br#"{"model":"m","messages":[],"temperature":"hot"}"#)
        .unwrap_err();
    assert_eq!(e.status.as_u16(), 400);
    assert_eq!(e.param.as_deref(), Some("temperature"));
    // A value's type names its field, not the value.
    for (body, field) in [
        (r#"{"model":123,"messages":[]}"#, "model"),
        (
            r#"{"model":"m","messages":[],"max_tokens":5.5}"#,
            "max_tokens",
        ),
        (r#"{"model":"m","messages":[],"user":7}"#, "user"),
        (r#"{"model":"m","messages":[],"stream":"yes"}"#, "stream"),
        (
            r#"{"model":"m","messages":[{"role":1}]}"#,
            "messages.[0].role",
        ),
        (
            r#"{"model":"m","messages":[],"user":7,"max_tokens":"x"}"#,
            "user",
        ),
    ] {
        let e = parse_body::<ChatRequest>(body.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(field), "{body}");
    }
    let e =
        parse_body::<CompletionRequest>(br#"{"model":"m","prompt":"x","echo":"yes"}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("echo"));
    // A whole number written as a float is that number; a fraction is not.
    let c = parse_body::<ChatRequest>(br#"{"model":"m","messages":[],"max_tokens":5.0,"n":1.0}"#)
        .unwrap();
    assert_eq!((c.common.max_tokens, c.common.n), (Some(5), Some(1)));
    let e =
        parse_body::<ChatRequest>(br#"{"model":"m","messages":[],"max_tokens":"5"}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
    assert!(
        e.message.contains("expected a whole number"),
        "{}",
        e.message
    );
    // Null is the default, as OpenAI's API allows.
    let c = parse_body::<CompletionRequest>(
        br#"{"model":"m","prompt":"x","echo":null,"stream":null,"ignore_eos":null}"#,
    )
    .unwrap();
    assert!(!c.echo && !c.common.stream && !c.common.ignore_eos);
}

#[test]
fn stop_accepts_string_or_short_list() {
    assert_eq!(
        stop_strings(&Some(Value::String("x".into()))).unwrap(),
        vec!["x"]
    );
    assert!(stop_strings(&Some(serde_json::json!(["a", "b", "c", "d", "e"]))).is_err());
    assert!(stop_strings(&Some(serde_json::json!([""]))).is_err());
    assert!(stop_strings(&Some(serde_json::json!(3))).is_err());
    assert!(stop_strings(&Some(serde_json::json!(["x".repeat(MAX_STOP_BYTES + 1)]))).is_err());
}

#[test]
fn options_out_of_range_name_their_field() {
    let cfg = GatewayConfig::default();
    for (body, field) in [
        (
            r#"{"model":"m","routing":{"overlap_weight":1e308}}"#,
            "routing.overlap_weight",
        ),
        (
            r#"{"model":"m","routing":{"host_hit_cost":2}}"#,
            "routing.host_hit_cost",
        ),
        (
            r#"{"model":"m","routing":{"disk_hit_cost":-1}}"#,
            "routing.disk_hit_cost",
        ),
        (
            r#"{"model":"m","routing":{"temperature":1000}}"#,
            "routing.temperature",
        ),
        (r#"{"model":"m","timeout_ms":0}"#, "timeout_ms"),
        (r#"{"model":"m","timeout_ms":99999999999}"#, "timeout_ms"),
        (r#"{"model":"m","max_migrations":1000}"#, "max_migrations"),
        (r#"{"model":"m","n":2}"#, "n"),
        (r#"{"model":"m","logprobs":true}"#, "logprobs"),
        // Completions' `logprobs: 0` asks for the sampled tokens' own.
        (r#"{"model":"m","logprobs":0}"#, "logprobs"),
        (r#"{"model":"m","logprobs":5}"#, "logprobs"),
        (r#"{"model":"m","top_logprobs":2}"#, "top_logprobs"),
        (
            r#"{"model":"m","presence_penalty":0.5}"#,
            "presence_penalty",
        ),
        (r#"{"model":"m","presence_penalty":""}"#, "presence_penalty"),
        (
            r#"{"model":"m","frequency_penalty":-1}"#,
            "frequency_penalty",
        ),
        (
            r#"{"model":"m","repetition_penalty":1.1}"#,
            "repetition_penalty",
        ),
        (
            r#"{"model":"m","repetition_penalty":0}"#,
            "repetition_penalty",
        ),
        (r#"{"model":"m","logit_bias":{"50256":-100}}"#, "logit_bias"),
        (r#"{"model":"m","best_of":3}"#, "best_of"),
        (r#"{"model":"m","best_of":0}"#, "best_of"),
        (r#"{"model":"m","suffix":"end"}"#, "suffix"),
        (r#"{"model":"m","min_tokens":4}"#, "min_tokens"),
        (
            r#"{"model":"m","min_tokens":8,"max_tokens":4,"ignore_eos":true}"#,
            "min_tokens",
        ),
        (
            r#"{"model":"m","min_tokens":4,"ignore_eos":true,"stop":"x"}"#,
            "min_tokens",
        ),
        (
            r#"{"model":"m","response_format":{"type":"json_object"}}"#,
            "response_format",
        ),
        (
            r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}]}"#,
            "tools",
        ),
        (
            r#"{"model":"m","tools":[{"type":"function"}],"tool_choice":"none"}"#,
            "tools",
        ),
        (r#"{"model":"m","functions":[{"name":"f"}]}"#, "functions"),
        (r#"{"model":"m","function_call":"auto"}"#, "function_call"),
        (
            r#"{"model":"m","guided_json":{"type":"object"}}"#,
            "guided_json",
        ),
        (
            r#"{"model":"m","guided_choice":["a","b"]}"#,
            "guided_choice",
        ),
        (
            r#"{"model":"m","structured_outputs":{"regex":"a+"}}"#,
            "structured_outputs",
        ),
        (
            r#"{"model":"m","chat_template_kwargs":{"enable_thinking":false}}"#,
            "chat_template_kwargs",
        ),
        (r#"{"model":"m","min_p":0.1}"#, "min_p"),
        (r#"{"model":"m","stop_token_ids":[2]}"#, "stop_token_ids"),
        (
            r#"{"model":"m","skip_special_tokens":false}"#,
            "skip_special_tokens",
        ),
        (r#"{"model":"m","echo":true}"#, "echo"),
        (r#"{"model":"m","tool_choice":"required"}"#, "tool_choice"),
        (
            r#"{"model":"m","tool_choice":{"type":"function","function":{"name":"f"}}}"#,
            "tool_choice",
        ),
        (
            r#"{"model":"m","stream_options":{"include_usage":true}}"#,
            "stream_options",
        ),
    ] {
        let p: CommonParams = serde_json::from_str(body).unwrap();
        let e = p.options(&cfg).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(field), "{body}");
        assert_eq!(e.status.as_u16(), 400);
    }
    // Unsupported options at their defaults, and unknown fields, pass.
    for body in [
        r#"{"model":"m","logprobs":false,"top_logprobs":0,"presence_penalty":0,"frequency_penalty":0.0}"#,
        r#"{"model":"m","repetition_penalty":1,"best_of":1,"logit_bias":{},"suffix":"","min_tokens":0}"#,
        r#"{"model":"m","response_format":{"type":"text"},"tools":[],"functions":[],"function_call":"none"}"#,
        r#"{"model":"m","logprobs":null,"guided_json":null,"user":"u","metadata":{"a":"b"},"store":false}"#,
        r#"{"model":"m","tool_choice":"auto","skip_special_tokens":true,"add_generation_prompt":true,"typical_p":1}"#,
        r#"{"model":"m","tool_choice":"none","stream":true,"stream_options":{"include_usage":true}}"#,
        r#"{"model":"m","stream":null,"stream_options":null}"#,
        // genai-perf's recipe: every request runs to max_tokens anyway.
        r#"{"model":"m","min_tokens":64,"max_tokens":64,"ignore_eos":true}"#,
    ] {
        let p: CommonParams = serde_json::from_str(body).unwrap();
        assert!(p.options(&cfg).is_ok(), "{body}");
    }
    // The endpoints' own fields never reach the catch-all.
    let c: ChatRequest = serde_json::from_str(
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"logprobs":true}"#,
    )
    .unwrap();
    assert!(!c.common.other.contains_key("messages"));
    assert!(c.common.other.contains_key("logprobs"));
    let c: CompletionRequest =
        serde_json::from_str(r#"{"model":"m","prompt":"hi","echo":true,"best_of":1}"#).unwrap();
    assert!(c.echo);
    assert!(!c.common.other.contains_key("prompt") && !c.common.other.contains_key("echo"));
    assert!(c.common.options(&cfg).is_ok());
    let p: CommonParams = serde_json::from_str(
        r#"{"model":"m","max_migrations":50,"routing":{"overlap_weight":1000}}"#,
    )
    .unwrap();
    let o = p.options(&cfg).unwrap();
    assert_eq!(
        o.max_migrations,
        Some(cfg.max_migrations),
        "capped by the gateway"
    );
}
