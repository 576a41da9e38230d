//! Kubernetes label selectors in their string form (`app=train,tier!=batch`,
//! `env in (a,b)`, `!legacy`), as `waitForCompletion.podSelector`,
//! `podDeletion.podSelector` and `drain.podSelector` are written.
//!
//! The grammar is the one `k8s.io/apimachinery/pkg/labels.Parse` accepts:
//! comma-separated requirements, each `key`, `!key`, `key=value`,
//! `key==value`, `key!=value`, `key in (v1,v2)`, `key notin (v1,v2)`,
//! `key>N` or `key<N`. Keys are qualified names (an optional DNS subdomain
//! prefix, `/`, then a name of at most 63 characters); values are at most 63
//! characters of `[A-Za-z0-9._-]`, starting and ending alphanumeric, or empty.
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a selector string does not parse, naming the offending part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{selector:?} is not a valid label selector: {problem}")]
pub struct SelectorError {
    /// The selector as written.
    pub selector: String,
    /// What is wrong, with the fix.
    pub problem: String,
}

/// The operator of one requirement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum SelectorOp {
    /// `key` : the label is present.
    Exists,
    /// `!key` : the label is absent.
    DoesNotExist,
    /// `key=value` or `key==value`.
    Equals,
    /// `key!=value` (also true when the label is absent).
    NotEquals,
    /// `key in (a,b)`.
    In,
    /// `key notin (a,b)` (also true when the label is absent).
    NotIn,
    /// `key>N`: the label is an integer greater than N.
    GreaterThan,
    /// `key<N`: the label is an integer less than N.
    LessThan,
}

/// One requirement of a selector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requirement {
    /// Label key.
    pub key: String,
    /// Operator.
    pub op: SelectorOp,
    /// Values (one for `=`, `!=`, `>`, `<`; one or more for `in`/`notin`).
    pub values: Vec<String>,
}

/// A parsed label selector: every requirement must hold. The empty selector
/// matches every label set.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LabelSelector {
    /// The requirements, in the order written.
    pub requirements: Vec<Requirement>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Word(String),
    Not,
    Eq,
    DoubleEq,
    NotEq,
    Gt,
    Lt,
    Comma,
    Open,
    Close,
}

fn is_word_char(c: char) -> bool {
    !c.is_whitespace() && !matches!(c, '!' | '=' | '>' | '<' | ',' | '(' | ')')
}

fn lex(s: &str) -> Vec<Token> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        let (tok, len) = match (c, next) {
            ('!', Some('=')) => (Token::NotEq, 2),
            ('!', _) => (Token::Not, 1),
            ('=', Some('=')) => (Token::DoubleEq, 2),
            ('=', _) => (Token::Eq, 1),
            ('>', _) => (Token::Gt, 1),
            ('<', _) => (Token::Lt, 1),
            (',', _) => (Token::Comma, 1),
            ('(', _) => (Token::Open, 1),
            (')', _) => (Token::Close, 1),
            _ => {
                let start = i;
                while i < chars.len() && is_word_char(chars[i]) {
                    i += 1;
                }
                out.push(Token::Word(chars[start..i].iter().collect()));
                continue;
            }
        };
        out.push(tok);
        i += len;
    }
    out
}

fn valid_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

fn valid_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            let b = part.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

fn check_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && !valid_dns_subdomain(p)
    {
        return Err(format!(
            "key prefix {p:?} is not a lowercase DNS subdomain such as \"nvidia.com\""
        ));
    }
    if !valid_name(name) {
        return Err(format!(
            "key {key:?} is not a label name: use at most 63 characters of letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

fn check_value(v: &str) -> Result<(), String> {
    if v.is_empty() || valid_name(v) {
        Ok(())
    } else {
        Err(format!(
            "value {v:?} is not a label value: use at most 63 characters of letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        ))
    }
}

impl LabelSelector {
    /// Parses a selector string; the empty (or all-blank) string selects everything.
    pub fn parse(selector: &str) -> Result<LabelSelector, SelectorError> {
        let err = |problem: String| SelectorError {
            selector: selector.to_string(),
            problem,
        };
        let tokens = lex(selector);
        let mut requirements = Vec::new();
        let mut i = 0;
        while i < tokens.len() {
            let (req, next) = parse_requirement(&tokens, i).map_err(err)?;
            requirements.push(req);
            i = next;
            match tokens.get(i) {
                None => break,
                Some(Token::Comma) => {
                    i += 1;
                    if i == tokens.len() {
                        return Err(err("it ends with ','; remove the trailing comma".into()));
                    }
                }
                Some(t) => {
                    return Err(err(format!(
                        "unexpected {t:?} after a requirement; separate requirements with ','"
                    )));
                }
            }
        }
        Ok(LabelSelector { requirements })
    }

    /// True when every requirement holds for `labels`.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| {
            let v = labels.get(&r.key);
            match r.op {
                SelectorOp::Exists => v.is_some(),
                SelectorOp::DoesNotExist => v.is_none(),
                SelectorOp::Equals | SelectorOp::In => v.is_some_and(|v| r.values.contains(v)),
                SelectorOp::NotEquals | SelectorOp::NotIn => {
                    v.is_none_or(|v| !r.values.contains(v))
                }
                SelectorOp::GreaterThan | SelectorOp::LessThan => {
                    let (Some(have), Some(bound)) = (
                        v.and_then(|v| v.parse::<i64>().ok()),
                        r.values.first().and_then(|b| b.parse::<i64>().ok()),
                    ) else {
                        return false;
                    };
                    if r.op == SelectorOp::GreaterThan {
                        have > bound
                    } else {
                        have < bound
                    }
                }
            }
        })
    }

    /// True for the empty selector.
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }
}

fn word(tokens: &[Token], i: usize, what: &str) -> Result<String, String> {
    match tokens.get(i) {
        Some(Token::Word(w)) => Ok(w.clone()),
        Some(t) => Err(format!("expected {what}, found {t:?}")),
        None => Err(format!("expected {what} at the end")),
    }
}

fn parse_requirement(tokens: &[Token], mut i: usize) -> Result<(Requirement, usize), String> {
    if tokens.get(i) == Some(&Token::Not) {
        let key = word(tokens, i + 1, "a label key after '!'")?;
        check_key(&key)?;
        return Ok((
            Requirement {
                key,
                op: SelectorOp::DoesNotExist,
                values: vec![],
            },
            i + 2,
        ));
    }
    let key = word(tokens, i, "a label key")?;
    check_key(&key)?;
    i += 1;
    let single = |op: SelectorOp, i: usize| -> Result<(Requirement, usize), String> {
        // A value may be empty (`key=` selects an empty value).
        let (value, next) = match tokens.get(i) {
            Some(Token::Word(w)) => (w.clone(), i + 1),
            _ => (String::new(), i),
        };
        if matches!(op, SelectorOp::GreaterThan | SelectorOp::LessThan)
            && value.parse::<i64>().is_err()
        {
            return Err(format!(
                "{value:?} after '>' or '<' is not an integer; compare against a whole number"
            ));
        }
        check_value(&value)?;
        Ok((
            Requirement {
                key: key.clone(),
                op,
                values: vec![value],
            },
            next,
        ))
    };
    match tokens.get(i) {
        None | Some(Token::Comma) => Ok((
            Requirement {
                key,
                op: SelectorOp::Exists,
                values: vec![],
            },
            i,
        )),
        Some(Token::Eq) | Some(Token::DoubleEq) => single(SelectorOp::Equals, i + 1),
        Some(Token::NotEq) => single(SelectorOp::NotEquals, i + 1),
        Some(Token::Gt) => single(SelectorOp::GreaterThan, i + 1),
        Some(Token::Lt) => single(SelectorOp::LessThan, i + 1),
        Some(Token::Word(w)) if w == "in" || w == "notin" => {
            let op = if w == "in" {
                SelectorOp::In
            } else {
                SelectorOp::NotIn
            };
            i += 1;
            if tokens.get(i) != Some(&Token::Open) {
                return Err(format!("expected '(' after {w:?}; write {key} {w} (a,b)"));
            }
            i += 1;
            let mut values = Vec::new();
            loop {
                match tokens.get(i) {
                    Some(Token::Word(v)) => {
                        check_value(v)?;
                        values.push(v.clone());
                        i += 1;
                    }
                    Some(Token::Comma) | Some(Token::Close) => values.push(String::new()),
                    _ => return Err(format!("the value list of {key:?} is not closed with ')'")),
                }
                match tokens.get(i) {
                    Some(Token::Comma) => i += 1,
                    Some(Token::Close) => {
                        i += 1;
                        break;
                    }
                    _ => return Err(format!("the value list of {key:?} is not closed with ')'")),
                }
            }
            Ok((Requirement { key, op, values }, i))
        }
        Some(t) => Err(format!(
            "unexpected {t:?} after key {key:?}; use =, ==, !=, in (...), notin (...), > or <"
        )),
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, r) in self.requirements.iter().enumerate() {
            if n > 0 {
                f.write_str(",")?;
            }
            let first = r.values.first().map(String::as_str).unwrap_or("");
            match r.op {
                SelectorOp::Exists => write!(f, "{}", r.key)?,
                SelectorOp::DoesNotExist => write!(f, "!{}", r.key)?,
                SelectorOp::Equals => write!(f, "{}={first}", r.key)?,
                SelectorOp::NotEquals => write!(f, "{}!={first}", r.key)?,
                SelectorOp::GreaterThan => write!(f, "{}>{first}", r.key)?,
                SelectorOp::LessThan => write!(f, "{}<{first}", r.key)?,
                SelectorOp::In => write!(f, "{} in ({})", r.key, r.values.join(","))?,
                SelectorOp::NotIn => write!(f, "{} notin ({})", r.key, r.values.join(","))?,
            }
        }
        Ok(())
    }
}
