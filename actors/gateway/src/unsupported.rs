//! OpenAI (and vLLM) request options this server does not implement.
//!
//! Invariant: such an option is refused with a 400 naming it whenever its
//! value would change what is generated, and passes only at its default
//! (as SDKs send it); it is never silently ignored. Other unknown fields
//! are ignored.

use crate::error::ApiError;
use crate::openai::CommonParams;
use serde_json::Value;

/// OpenAI (and vLLM) options this server does not implement. A value other
/// than the option's default ([`at_default`]) is refused: ignoring it would
/// hand back something other than what was asked for.
pub const UNSUPPORTED: &[&str] = &[
    // Sampling.
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "typical_p",
    "min_tokens",
    "best_of",
    "use_beam_search",
    "length_penalty",
    "stop_token_ids",
    // What comes back.
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "suffix",
    "include_stop_str_in_output",
    "skip_special_tokens",
    // Structured output and tools.
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    // The prompt.
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "truncate_prompt_tokens",
    "reasoning_effort",
];

/// Whether `v`, the value of the unsupported option `name` in `p`, leaves
/// it at its default: `null` always; otherwise the value the option has
/// when it is not sent (`false`, `0`, `1`, empty, `{"type": "text"}`, …).
/// `min_tokens` also passes where it cannot change anything: with
/// `ignore_eos`, no `stop` and at most `max_tokens` (the usual benchmark
/// recipe).
pub fn at_default(name: &str, v: &Value, p: &CommonParams) -> bool {
    let num = |x: f64| v.as_f64() == Some(x);
    let empty_array = || v.as_array().is_some_and(|a| a.is_empty());
    let empty_object = || v.as_object().is_some_and(|o| o.is_empty());
    v.is_null()
        || match name {
            "logprobs"
            | "use_beam_search"
            | "echo"
            | "include_stop_str_in_output"
            | "continue_final_message" => v == &Value::Bool(false),
            "skip_special_tokens" | "add_generation_prompt" => v == &Value::Bool(true),
            "frequency_penalty" | "presence_penalty" | "min_p" | "top_logprobs" => num(0.0),
            "repetition_penalty" | "typical_p" | "best_of" | "length_penalty" => num(1.0),
            "min_tokens" => {
                let no_stop = p.stop.as_ref().is_none_or(|s| match s {
                    Value::Null => true,
                    Value::String(x) => x.is_empty(),
                    Value::Array(a) => a.is_empty(),
                    _ => false,
                });
                let max = p.max_completion_tokens.or(p.max_tokens);
                num(0.0)
                    || (p.ignore_eos
                        && no_stop
                        && v.as_i64()
                            .is_some_and(|m| m >= 0 && max.is_none_or(|x| m <= x)))
            }
            "logit_bias" | "structured_outputs" | "chat_template_kwargs" => empty_object(),
            "tools" | "functions" | "stop_token_ids" => empty_array(),
            "suffix" | "chat_template" => v.as_str() == Some(""),
            "function_call" => v.as_str() == Some("none"),
            // Without tools, "auto" and "none" mean the same: no tool call.
            "tool_choice" => matches!(v.as_str(), Some("none" | "auto")),
            "response_format" => {
                v.as_object().is_some_and(|o| o.len() == 1)
                    && v.get("type").and_then(Value::as_str) == Some("text")
            }
            _ => false,
        }
}

/// Refuses the first option of [`UNSUPPORTED`] in `p` that is not at its
/// default.
pub fn check(p: &CommonParams) -> Result<(), ApiError> {
    for name in UNSUPPORTED {
        if let Some(v) = p.other.get(*name) {
            if !at_default(name, v, p) {
                return Err(ApiError::invalid(
                    Some((*name).into()),
                    format!("`{name}` is not supported by this server; send the request without it (or at its default)."),
                ));
            }
        }
    }
    Ok(())
}
