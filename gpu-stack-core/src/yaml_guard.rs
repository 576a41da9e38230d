//! A cheap check of YAML input before it reaches the YAML parser.
//!
//! Deeply nested documents (`[[[[…` or `{a: {a: …`, or one more indented key
//! per line) take the parser seconds or more to refuse. [`check`] scans the
//! text once, in linear time, and refuses any document that nests deeper than
//! [`MAX_DEPTH`] levels or is larger than [`MAX_BYTES`], so callers can reject
//! such input before parsing it.
//!
//! The scan counts flow nesting (`[` and `{` outside quoted strings and
//! comments) and block nesting (indentation levels and `- ` / `? ` markers).
//! It does not validate YAML: it may count a level more than the parser would
//! see, never one less for the nesting it understands; the limit is far beyond
//! what any gpu-stack file needs.
//!
//! ```
//! use gpu_stack_core::yaml_guard;
//!
//! assert!(yaml_guard::check("version: v1\nflags: {migStrategy: mixed}\n").is_ok());
//! let deep = "[".repeat(10_000);
//! assert!(matches!(
//!     yaml_guard::check(&deep),
//!     Err(yaml_guard::DepthError::TooDeep { .. })
//! ));
//! ```

/// Deepest nesting [`check`] accepts: flow and block levels together, the
/// document's top-level block (if any) counting as one.
pub const MAX_DEPTH: usize = 64;

/// Largest document [`check`] accepts, in bytes (16 MiB).
pub const MAX_BYTES: usize = 16 * 1024 * 1024;

/// Why a YAML text was refused before parsing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DepthError {
    /// The text nests deeper than allowed.
    #[error(
        "YAML nests deeper than {max} levels (line {line}, column {column}); \
         flatten the document: no gpu-stack file needs that much nesting"
    )]
    TooDeep {
        /// The limit.
        max: usize,
        /// 1-based line where the limit was passed.
        line: usize,
        /// 1-based byte column where the limit was passed.
        column: usize,
    },
    /// The text is larger than allowed.
    #[error(
        "YAML is {bytes} bytes, more than the {max} bytes allowed; \
         split it into smaller files or remove what is not needed"
    )]
    TooLarge {
        /// Size of the text.
        bytes: usize,
        /// The limit.
        max: usize,
    },
}

/// The parser options every gpu-stack YAML input is read with: YAML 1.2
/// booleans only (`true`/`false`, also capitalised; `yes`, `no`, `on` and
/// `off` stay strings), duplicate keys refused, and serde-saphyr's default
/// budget for aliases and document size.
pub fn options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        strict_booleans: true,
    }
}

/// Parses `text` with [`options`]. Callers run [`check`] first.
pub fn from_str<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, serde_saphyr::Error> {
    serde_saphyr::from_str_with_options(text, options())
}

/// A parse error on one line, without the source snippet: the parser's
/// message, which names the line and column where it has them.
pub fn message(e: &serde_saphyr::Error) -> String {
    let plain = e.without_snippet().to_string();
    let plain = plain.split_whitespace().collect::<Vec<_>>().join(" ");
    match e.location() {
        Some(l) if !plain.contains("line ") => {
            format!("{plain} at line {} column {}", l.line(), l.column())
        }
        _ => plain,
    }
}

/// [`check_limits`] with [`MAX_DEPTH`] and [`MAX_BYTES`].
pub fn check(text: &str) -> Result<(), DepthError> {
    check_limits(text, MAX_DEPTH, MAX_BYTES)
}

/// [`check_limits`] with `max_depth` and [`MAX_BYTES`].
pub fn check_depth(text: &str, max_depth: usize) -> Result<(), DepthError> {
    check_limits(text, max_depth, MAX_BYTES)
}

/// Refuses `text` when it is larger than `max_bytes` or nests deeper than
/// `max_depth` levels (flow and block nesting together). One pass over the
/// text; memory bounded by `max_depth`.
pub fn check_limits(text: &str, max_depth: usize, max_bytes: usize) -> Result<(), DepthError> {
    if text.len() > max_bytes {
        return Err(DepthError::TooLarge {
            bytes: text.len(),
            max: max_bytes,
        });
    }
    let mut s = Scanner {
        max: max_depth,
        blocks: Vec::new(),
        flow: 0,
        quote: None,
        block_scalar: None,
    };
    for (n, raw) in text.split('\n').enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw).as_bytes();
        s.line(line, n + 1)?;
    }
    Ok(())
}

struct Scanner {
    max: usize,
    /// Columns of the open block levels, increasing.
    blocks: Vec<usize>,
    /// Open `[` / `{`.
    flow: usize,
    /// The quote character of a quoted scalar still open at the end of a line.
    quote: Option<u8>,
    /// Indentation of the line that opened a `|` / `>` block scalar.
    block_scalar: Option<usize>,
}

fn is_ws(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

impl Scanner {
    fn too_deep(&self, line: usize, col: usize) -> DepthError {
        DepthError::TooDeep {
            max: self.max,
            line,
            column: col + 1,
        }
    }

    fn check(&self, line: usize, col: usize) -> Result<(), DepthError> {
        if self.blocks.len() + self.flow > self.max {
            Err(self.too_deep(line, col))
        } else {
            Ok(())
        }
    }

    /// Enters the block level at `col`, closing the deeper ones.
    fn enter(&mut self, col: usize, line: usize) -> Result<(), DepthError> {
        while self.blocks.last().is_some_and(|&top| top > col) {
            self.blocks.pop();
        }
        if self.blocks.last() != Some(&col) {
            self.blocks.push(col);
        }
        self.check(line, col)
    }

    fn line(&mut self, line: &[u8], n: usize) -> Result<(), DepthError> {
        let indent = line.iter().take_while(|&&b| b == b' ').count();
        let blank = line.iter().all(|&b| is_ws(b));
        if let Some(parent) = self.block_scalar {
            if blank || indent > parent {
                return Ok(());
            }
            self.block_scalar = None;
        }
        if self.quote.is_some() || self.flow > 0 {
            // Indentation means nothing inside quotes or flow collections.
            let expect_value = self.flow > 0;
            return self.scan(line, 0, expect_value, indent, n);
        }
        if blank || line.get(indent) == Some(&b'#') {
            return Ok(());
        }
        // Block levels: the indentation, then one per `- ` / `? ` marker.
        let mut col = indent;
        loop {
            self.enter(col, n)?;
            let marker = matches!(line.get(col), Some(b'-' | b'?'))
                && line.get(col + 1).is_none_or(|&b| is_ws(b));
            if !marker {
                break;
            }
            col += 1;
            while line.get(col).is_some_and(|&b| is_ws(b)) {
                col += 1;
            }
            if col >= line.len() || line.get(col) == Some(&b'#') {
                return Ok(());
            }
        }
        self.scan(line, col, true, indent, n)
    }

    /// Scans `line[from..]` for quotes, flow brackets, comments and block
    /// scalar indicators. `expect_value`: a scalar or collection may start here.
    fn scan(
        &mut self,
        line: &[u8],
        from: usize,
        mut expect_value: bool,
        indent: usize,
        n: usize,
    ) -> Result<(), DepthError> {
        let mut i = from;
        let mut after_ws = true;
        let mut in_property = false;
        while let Some(&b) = line.get(i) {
            if let Some(q) = self.quote {
                if q == b'"' && b == b'\\' {
                    i += 2;
                    continue;
                }
                if b == q {
                    if q == b'\'' && line.get(i + 1) == Some(&b'\'') {
                        i += 2;
                        continue;
                    }
                    self.quote = None;
                    expect_value = false;
                    after_ws = false;
                }
                i += 1;
                continue;
            }
            if is_ws(b) {
                after_ws = true;
                in_property = false;
                i += 1;
                continue;
            }
            if b == b'#' && after_ws {
                return Ok(());
            }
            after_ws = false;
            if in_property {
                i += 1;
                continue;
            }
            match b {
                b'"' | b'\'' if expect_value => {
                    self.quote = Some(b);
                }
                b'[' | b'{' if expect_value || self.flow > 0 => {
                    self.flow += 1;
                    self.check(n, i)?;
                    expect_value = true;
                }
                b']' | b'}' if self.flow > 0 => {
                    self.flow -= 1;
                    expect_value = false;
                }
                b',' if self.flow > 0 => expect_value = true,
                b':' if self.flow > 0 || line.get(i + 1).is_none_or(|&c| is_ws(c)) => {
                    expect_value = true;
                }
                // Tags and anchors come before the node they name.
                b'!' | b'&' if expect_value => in_property = true,
                b'|' | b'>' if expect_value && self.flow == 0 => {
                    if is_block_scalar_header(&line[i..]) {
                        self.block_scalar = Some(indent);
                        return Ok(());
                    }
                    expect_value = false;
                }
                _ => expect_value = false,
            }
            i += 1;
        }
        Ok(())
    }
}

/// `|`, `>`, with optional `-`/`+`/digit indicators, then nothing but a comment.
fn is_block_scalar_header(rest: &[u8]) -> bool {
    let body = rest
        .iter()
        .skip(1)
        .take_while(|&&b| b == b'-' || b == b'+' || b.is_ascii_digit())
        .count();
    let tail = &rest[(1 + body).min(rest.len())..];
    let tail_start = tail.iter().take_while(|&&b| is_ws(b)).count();
    match tail.get(tail_start) {
        None => true,
        Some(b'#') => tail_start > 0,
        Some(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parse_errors_are_one_line_and_name_the_position() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct T {
            a: u32,
        }
        for (text, want) in [
            ("a: [1\n", "line "),
            ("a: x\n", "line 1"),
            ("b: 1\n", "line 1"),
            ("a: 1\na: 2\n", "line 2"),
        ] {
            let e = from_str::<T>(text).unwrap_err();
            let m = message(&e);
            eprintln!("{text:?}: {m}");
            assert!(m.contains(want) && m.contains("column"), "{text:?}: {m}");
            assert!(!m.contains('\n'), "{text:?}: {m}");
        }
    }

    #[test]
    fn only_yaml_1_2_booleans_are_booleans() {
        let v: serde_json::Value = from_str("a: yes\nb: on\nc: true\nd: false\n").unwrap();
        assert_eq!(v["a"], "yes");
        assert_eq!(v["b"], "on");
        assert_eq!(v["c"], true);
        assert_eq!(v["d"], false);
        assert!(from_str::<bool>("yes").is_err());
    }

    fn deep(kind: &str, n: usize) -> String {
        match kind {
            "seq" => format!("{}{}", "[".repeat(n), "]".repeat(n)),
            "map" => format!("{}1{}", "{a: ".repeat(n), "}".repeat(n)),
            "block" => (0..n).map(|i| format!("{}a:\n", " ".repeat(i))).collect(),
            "dash" => format!("{}a\n", "- ".repeat(n)),
            _ => unreachable!(),
        }
    }

    #[test]
    fn very_deep_documents_are_refused() {
        for kind in ["seq", "map", "block", "dash"] {
            // One more indented line per level grows quadratically: 3,000
            // lines are already 4.5 MB.
            let levels = if kind == "block" { 3_000 } else { 100_000 };
            let text = deep(kind, levels);
            let e = check(&text).unwrap_err();
            assert!(
                matches!(e, DepthError::TooDeep { max: MAX_DEPTH, .. }),
                "{kind}: {e}"
            );
            assert!(e.to_string().contains("flatten"), "{e}");
            // Unclosed is refused just the same.
            let open = match kind {
                "seq" => "[".repeat(100_000),
                "map" => "{a: ".repeat(100_000),
                _ => continue,
            };
            assert!(matches!(check(&open), Err(DepthError::TooDeep { .. })));
        }
    }

    #[test]
    fn nesting_up_to_the_limit_is_accepted() {
        // Block: MAX_DEPTH indented keys. Flow: the line's own block level
        // and MAX_DEPTH - 1 brackets.
        assert_eq!(check(&deep("seq", MAX_DEPTH - 1)), Ok(()));
        assert_eq!(check(&deep("block", MAX_DEPTH)), Ok(()));
        assert!(check(&deep("seq", MAX_DEPTH)).is_err());
        assert!(check(&deep("block", MAX_DEPTH + 1)).is_err());
        assert_eq!(check_depth(&deep("map", 2), 3), Ok(()));
        assert!(check_depth(&deep("map", 3), 3).is_err());
    }

    #[test]
    fn brackets_in_strings_comments_and_block_scalars_do_not_count() {
        let brackets = "[".repeat(200);
        let docs = [
            format!("a: \"{brackets}\"\n"),
            format!("a: '{brackets}'\n"),
            format!("a: 'it''s {brackets}'\n"),
            format!("a: \"esc \\\" {brackets}\"\n"),
            format!("a: 1 # {brackets}\n"),
            format!("# {brackets}\n"),
            format!("a: plain{brackets}\n"),
            format!("a: |\n  {brackets}\n\n  more {brackets}\nb: 2\n"),
            format!("- >-\n    {brackets}\n- 2\n"),
            format!("a: \"multi\n  line {brackets}\n  \"\n"),
            format!("{{\"a\": \"{brackets}\", \"b\": [1, 2]}}\n"),
            format!("a: !!str '{brackets}'\n"),
            format!("a: x \"{brackets}\n"),
        ];
        for d in &docs {
            assert_eq!(check(d), Ok(()), "{d}");
        }
    }

    #[test]
    fn error_names_the_line_and_limits() {
        let text = format!("a: 1\nb: {}\n", "[".repeat(100));
        let e = check(&text).unwrap_err();
        assert_eq!(
            e,
            DepthError::TooDeep {
                max: MAX_DEPTH,
                line: 2,
                column: 3 + MAX_DEPTH
            }
        );
        let e = check_limits("a: 1\n", 64, 3).unwrap_err();
        assert_eq!(e, DepthError::TooLarge { bytes: 5, max: 3 });
        assert!(e.to_string().contains("split"), "{e}");
    }

    proptest! {
        #[test]
        fn flow_depth_is_counted_exactly(n in 0usize..200) {
            prop_assert_eq!(check(&deep("seq", n)).is_ok(), n < MAX_DEPTH);
        }

        #[test]
        fn never_panics(text in "[\\[\\]{}:,'\"#|>!&\\- a\n\\\\]{0,200}") {
            let _ = check(&text);
        }
    }
}
