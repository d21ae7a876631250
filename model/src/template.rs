//! Chat templates (HF Jinja conventions) rendered with minijinja.
//!
//! The template is compiled once; rendering is a pure function of the
//! messages. Python-isms common in HF templates (`.strip()`, `.startswith()`,
//! `raise_exception`, `tojson`) are supported.

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// One chat message as the template sees it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned(NAME.to_string(), source.to_string())
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    /// Renders the conversation, ending with the assistant's turn opener.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, TemplateError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| TemplateError::Render(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_reports_template_errors() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content.strip() }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            None,
            None,
        )
        .unwrap();
        let out = t
            .render(&[ChatMessage {
                role: "user".into(),
                content: "  hi ".into(),
            }])
            .unwrap();
        assert_eq!(out, "<user>hi<assistant>");
        let bad = ChatTemplate::new("{{ raise_exception('no system role') }}", None, None).unwrap();
        let err = bad.render(&[]).unwrap_err().to_string();
        assert!(err.contains("no system role"), "{err}");
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }
}
