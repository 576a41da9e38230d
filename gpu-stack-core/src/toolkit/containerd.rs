//! containerd: the drop-in that turns on CDI (and adds a plain-runc runtime
//! handler), the main config's `imports` entry that loads it, and what a
//! running containerd still lacks.
//!
//! containerd before 2.1 replaces, rather than merges, a whole plugin table
//! that a drop-in sets. So the drop-in is not just our keys: it is a copy of
//! the main config's entire CRI table with our keys merged in, or the user's
//! CRI settings (sandbox image, CNI, `SystemdCgroup`, ...) would be lost.
//!
//! Limitation: a CRI table set by another drop-in that the main config
//! imports is not seen here; containerd applies imports in order, so ours,
//! imported last, wins over it.

use std::fmt;
use std::ops::Range;

use toml_edit::{Array, Document, DocumentMut, Item, Table, Value};

use super::{ConfigError, RuntimeOptions, parse_error};
use crate::echo;

/// How the messages name the file.
const WHAT: &str = "containerd config";

/// Where containerd reads CDI specs from when the config does not say.
pub const DEFAULT_CDI_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// The runc shim: the only runtime type a plain-runc handler may have.
pub const RUNC_V2: &str = "io.containerd.runc.v2";

/// The `version` line [`add_import`] writes into a comment-only file. It says
/// where it came from, so [`remove_import`] can take it away again and leave
/// the user's file as it was.
pub const ADDED_VERSION_LINE: &str =
    "version = 2 # added by gpu-stack's toolkit agent with `imports`\n";

/// The schema of a containerd config file, from its `version` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConfigVersion {
    /// No `version` key but settings: containerd 1.5 and older, `plugins.cri`.
    /// No drop-in support.
    V1,
    /// `version = 2` (or no file, or an empty one): containerd 1.x.
    V2,
    /// `version = 3`: containerd 2.x.
    V3,
}

impl ConfigVersion {
    /// The number in the `version` key.
    pub fn number(self) -> i64 {
        match self {
            ConfigVersion::V1 => 1,
            ConfigVersion::V2 => 2,
            ConfigVersion::V3 => 3,
        }
    }
}

impl fmt::Display for ConfigVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "version {}", self.number())
    }
}

/// The schema of the main config `main` (None: there is no file). A missing,
/// empty or comment-only file is version 2 (what containerd assumes); a file
/// with settings but no `version` key is version 1.
pub fn detect_version(main: Option<&str>) -> Result<ConfigVersion, ConfigError> {
    match main {
        None => Ok(ConfigVersion::V2),
        Some(text) => version_of(parse_mut(text)?.as_table()),
    }
}

/// Whether containerd `runtime_version` (as its CRI `Version` reports it:
/// `v2.3.7`, `1.7.35`) can take a drop-in for a main config of `config`:
/// containerd 1.7 reads version 2, 2.x reads version 3 and migrates version
/// 2 at start. Older releases drop `enable_cdi` and `cdi_spec_dirs` from a
/// drop-in and ignore CDI devices; a major this agent does not know may read
/// another schema. Both are refused before any file is written.
pub fn check_containerd(runtime_version: &str, config: ConfigVersion) -> Result<(), ConfigError> {
    let refuse = |reason| ConfigError::UnsupportedRuntime {
        version: runtime_version.chars().take(64).collect(),
        reason,
    };
    let mut parts = runtime_version.trim().trim_start_matches('v').split('.');
    let number = |p: Option<&str>| -> Option<u32> {
        let digits: String = p?.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    };
    let (Some(major), Some(minor)) = (number(parts.next()), number(parts.next())) else {
        return Err(refuse(
            "that is not a containerd version this agent can read (it knows 1.7 and 2.x); \
             check the runtime behind the socket, or configure it by hand",
        ));
    };
    match (major, minor) {
        (1, 0..=6) | (0, _) => Err(refuse(
            "containerd before 1.7 drops enable_cdi and cdi_spec_dirs from a drop-in and \
             ignores CDI devices, so GPUs would never reach pods; upgrade containerd to 2.x \
             (or at least 1.7)",
        )),
        (1, _) if config == ConfigVersion::V3 => Err(refuse(
            "containerd 1.x reads config version 2, but its config says version 3; give it a \
             version 2 config (`containerd config default` of that release) or upgrade \
             containerd to 2.x",
        )),
        (1 | 2, _) => Ok(()),
        _ => Err(refuse(
            "this agent knows containerd 1.7 and 2.x, and a new major may read another config \
             schema; use a gpu-stack release that supports it, or configure the runtime by \
             hand and turn the toolkit off",
        )),
    }
}

/// The path of the table holding the CRI keys we set (`enable_cdi`,
/// `cdi_spec_dirs`, `containerd.runtimes`) in a config of version `v`.
pub fn cri_table_path(v: ConfigVersion) -> &'static [&'static str] {
    match v {
        ConfigVersion::V1 => &["plugins", "cri"],
        ConfigVersion::V2 => &["plugins", "io.containerd.grpc.v1.cri"],
        ConfigVersion::V3 => &["plugins", "io.containerd.cri.v1.runtime"],
    }
}

/// The drop-in text for `main` (None = no main config file). Deterministic:
/// same input, same bytes.
///
/// The drop-in has the main config's `version`, a copy of its whole CRI table
/// (formatting normalized, comments dropped) with `enable_cdi = true`,
/// `cdi_spec_dirs` (the config's dirs, or containerd's defaults, plus ours)
/// and, if asked, `containerd.runtimes.<handler>`: a copy of the first
/// low-level runtime (the default runtime unless its name starts with
/// `nvidia`, then `runc`, then `crun`; only runc-shim ones count) without a
/// `BinaryName` that names an NVIDIA binary. The handler never becomes the
/// default runtime; a runtime of the same name in the main config (e.g.
/// NVIDIA's shim handler `nvidia`) is replaced by it. With a handler, the
/// drop-in also names containerd's built-in `runc` runtime when that is the
/// default and the main config does not define it: containerd would drop it
/// otherwise.
pub fn render_drop_in(main: Option<&str>, opts: &RuntimeOptions) -> Result<String, ConfigError> {
    opts.validate()?;
    let doc = parse_mut(main.unwrap_or(""))?;
    let version = version_of(doc.as_table())?;
    if version == ConfigVersion::V1 {
        return Err(version1(doc.as_table()));
    }
    let path = cri_table_path(version);
    let mut cri = lookup(doc.as_table(), path, 0)?.unwrap_or_default();
    normalize_table(&mut cri);
    cri.set_implicit(false);

    cri.insert("enable_cdi", toml_edit::value(true));
    let dirs = merged_spec_dirs(&cri, path, &opts.cdi_spec_dirs)?;
    cri.insert("cdi_spec_dirs", Item::Value(Value::Array(dirs)));
    if let Some(handler) = opts.handler() {
        add_handler(&mut cri, path, handler)?;
    }

    let mut out = DocumentMut::new();
    out.insert("version", toml_edit::value(version.number()));
    let mut plugins = Table::new();
    plugins.set_implicit(true);
    plugins.insert(path[1], Item::Table(cri));
    out.insert(path[0], Item::Table(plugins));
    // Parents before children, in key order: readable, and independent of
    // where the tables stood in the user's file.
    let mut next = 0;
    number_tables(out.as_table_mut(), &mut next);
    Ok(format!("{}{out}", drop_in_header(opts)))
}

fn drop_in_header(opts: &RuntimeOptions) -> String {
    let adds = match opts.handler() {
        Some(h) => {
            format!("\n# the CDI settings and the runtime handler \"{h}\" (plain runc, no shim).")
        }
        None => "\n# the CDI settings.".to_string(),
    };
    format!(
        "# Written by gpu-stack's toolkit agent; removed when the toolkit is uninstalled.\n\
         # containerd before 2.1 replaces, not merges, a plugin table that a drop-in\n\
         # sets, so this file holds a copy of the main config's CRI table plus{adds}\n\
         # Edit the main config instead: the agent copies its CRI table again.\n"
    )
}

/// Whether `main` has a top-level `imports` key (so removing our entry must
/// keep the key), decided before [`add_import`] edits it. A file that does not
/// parse has none.
pub fn has_imports(main: Option<&str>) -> bool {
    main.and_then(|m| m.parse::<toml_edit::DocumentMut>().ok())
        .is_some_and(|d| d.contains_key("imports"))
}

/// `main` with `import` (an absolute path, our drop-in file) added to
/// `imports`; Ok(None) when `main` already imports it, exactly or through a
/// glob entry that matches it (`*` and `?` in the last path component). With
/// `main == None` returns a new file `version = 2\nimports = [...]\n`.
///
/// Adds a `version = 2` line (see [`ADDED_VERSION_LINE`]) at the top only
/// when the file has no `version` key and is otherwise empty (comments only).
/// Byte-for-byte: everything outside the `imports` key (comments, blank
/// lines, key order, quoting, indentation) is untouched; a new `imports` key
/// goes right after the `version` line (or at the top).
pub fn add_import(main: Option<&str>, import: &str) -> Result<Option<String>, ConfigError> {
    validate_import(import)?;
    let entry = toml_string(import);
    let Some(text) = main else {
        return Ok(Some(format!("version = 2\nimports = [{entry}]\n")));
    };
    let doc = parse_spanned(text)?;
    let root = doc.as_table();
    if version_of(root)? == ConfigVersion::V1 {
        return Err(version1(root));
    }
    let inserts: Vec<(usize, String)> = match root.get("imports") {
        Some(item) => {
            let imports = imports_array(item)?;
            for e in imports.iter() {
                let e = e.as_str().ok_or(ConfigError::WrongType {
                    what: WHAT,
                    key: "imports".into(),
                    expected: "an array of paths (strings)",
                    found: value_kind(e),
                })?;
                if covers(e, import) {
                    return Ok(None);
                }
            }
            match imports.iter().last() {
                Some(last) => {
                    let last = span(last.span(), "imports")?;
                    match (
                        own_line_start(text, last.start),
                        rest_of_line(text, last.end),
                    ) {
                        // The last entry has a line of its own: ours goes on
                        // the next line, indented and punctuated like it, and
                        // a comment after it stays where it is.
                        (Some(line), Some((comma, after, nl))) => {
                            let indent = &text[line..last.start];
                            match comma {
                                Some(_) => vec![(after, format!("{indent}{entry},{nl}"))],
                                None => vec![
                                    (last.end, ",".to_string()),
                                    (after, format!("{indent}{entry}{nl}")),
                                ],
                            }
                        }
                        // Otherwise right after it, on its line or the next.
                        _ => vec![(
                            last.end,
                            format!(",{}{entry}", separator_after(text, last.start)),
                        )],
                    }
                }
                None => vec![(span(imports.span(), "imports")?.start + 1, entry)],
            }
        }
        None => {
            let eol = if text.contains("\r\n") { "\r\n" } else { "\n" };
            match root.get("version") {
                Some(v) => match line_end(text, span(v.span(), "version")?.end) {
                    (at, Some(nl)) => vec![(at, format!("imports = [{entry}]{nl}"))],
                    (at, None) => vec![(at, format!("{eol}imports = [{entry}]"))],
                },
                None => vec![(0, format!("{ADDED_VERSION_LINE}imports = [{entry}]{eol}"))],
            }
        }
    };
    let mut out =
        String::with_capacity(text.len() + inserts.iter().map(|(_, s)| s.len()).sum::<usize>());
    let mut from = 0;
    for (at, insert) in &inserts {
        out.push_str(&text[from..*at]);
        out.push_str(insert);
        from = *at;
    }
    out.push_str(&text[from..]);
    Ok(Some(out))
}

/// Inverse of [`add_import`] for a file that may have been edited since:
/// removes exactly the entry `import` (every copy of it), and the whole
/// `imports` key if it then is empty and `remove_empty_key` (we added the
/// key), keeping the rest untouched. A `version` line that [`add_import`]
/// added to a comment-only file goes with the key. A file without the entry
/// comes back unchanged.
pub fn remove_import(
    main: &str,
    import: &str,
    remove_empty_key: bool,
) -> Result<String, ConfigError> {
    let mut text = main.to_string();
    loop {
        let doc = parse_spanned(&text)?;
        let root = doc.as_table();
        let Some((key, item)) = root.get_key_value("imports") else {
            return Ok(text);
        };
        let imports = imports_array(item)?;
        let values: Vec<&Value> = imports.iter().collect();
        let Some(i) = values.iter().position(|v| v.as_str() == Some(import)) else {
            if !(remove_empty_key && values.is_empty()) {
                return Ok(text);
            }
            let cut = key_lines(
                &text,
                span(key.span(), "imports")?.start,
                span(item.span(), "imports")?.end,
            );
            text.replace_range(cut, "");
            if let Some(rest) = text.strip_prefix(ADDED_VERSION_LINE)
                && parse_spanned(rest)?.as_table().is_empty()
            {
                text = rest.to_string();
            }
            return Ok(text);
        };
        let (cut, comma_before) = entry_cuts(&text, &values, i, imports.trailing_comma())?;
        text.replace_range(cut, "");
        // It lies before the cut, so its offsets still hold.
        if let Some(comma) = comma_before {
            text.replace_range(comma, "");
        }
    }
}

/// The bytes to cut to remove entry `i`, undoing exactly what [`add_import`]
/// inserts: an entry on a line of its own goes with its line (and, when it was
/// the last one without a trailing comma, with the comma before it); else a
/// later entry goes from the comma before it, the first through to the next
/// entry or the trailing comma.
fn entry_cuts(
    text: &str,
    values: &[&Value],
    i: usize,
    trailing_comma: bool,
) -> Result<(Range<usize>, Option<Range<usize>>), ConfigError> {
    let this = span(values[i].span(), "imports")?;
    let last = i + 1 == values.len();
    if let (Some(line), Some((comma, after, _))) = (
        own_line_start(text, this.start),
        rest_of_line(text, this.end),
    ) && (comma.is_some() || last)
    {
        let mut comma_before = None;
        if comma.is_none() && i > 0 {
            let prev = span(values[i - 1].span(), "imports")?.end;
            comma_before = next_comma(text, prev).map(|c| c..c + 1);
        }
        return Ok((line..after, comma_before));
    }
    if i > 0 {
        let prev = span(values[i - 1].span(), "imports")?.end;
        let comma = next_comma(text, prev).unwrap_or(prev);
        return Ok((comma..this.end, None));
    }
    let cut = match values.get(1) {
        Some(next) => this.start..span(next.span(), "imports")?.start,
        None if trailing_comma => {
            this.start..next_comma(text, this.end).map_or(this.end, |c| c + 1)
        }
        None => this,
    };
    Ok((cut, None))
}

/// The start of the line holding `at` when only blanks precede `at` on it.
fn own_line_start(text: &str, at: usize) -> Option<usize> {
    let line = text[..at].rfind('\n')? + 1;
    text[line..at]
        .chars()
        .all(|c| c == ' ' || c == '\t')
        .then_some(line)
}

/// After an array entry ending at `end`: blanks, maybe a comma, blanks, maybe
/// a comment, then the line end. Returns the comma's offset, the offset after
/// the line end, and the line end; None when something else follows first.
fn rest_of_line(text: &str, end: usize) -> Option<(Option<usize>, usize, &'static str)> {
    let mut comma = None;
    let mut in_comment = false;
    for (i, c) in text[end..].char_indices() {
        let at = end + i;
        match c {
            '\n' => {
                let nl = if text[..at].ends_with('\r') {
                    "\r\n"
                } else {
                    "\n"
                };
                return Some((comma, at + 1, nl));
            }
            _ if in_comment => {}
            '#' => in_comment = true,
            ',' if comma.is_none() => comma = Some(at),
            ' ' | '\t' | '\r' => {}
            _ => return None,
        }
    }
    None
}

/// The lines of a key-value from `key_start` to `value_end`, with the line end
/// after it, or the one before it when the key is the file's last line.
fn key_lines(text: &str, key_start: usize, value_end: usize) -> Range<usize> {
    let line_start = text[..key_start].rfind('\n').map_or(0, |i| i + 1);
    let start = if text[line_start..key_start].trim().is_empty() {
        line_start
    } else {
        key_start
    };
    match line_end(text, value_end) {
        (end, Some(_)) => start..end,
        (end, None) if start == line_start && start > 0 => {
            let before = if text[..start].ends_with("\r\n") {
                2
            } else {
                1
            };
            start - before..end
        }
        (end, None) => start..end,
    }
}

/// The offset after the end of the line holding `at` and that line ending,
/// or the text's length and None on the last line.
fn line_end(text: &str, at: usize) -> (usize, Option<&'static str>) {
    match text[at..].find('\n') {
        Some(i) if text[..at + i].ends_with('\r') => (at + i + 1, Some("\r\n")),
        Some(i) => (at + i + 1, Some("\n")),
        None => (text.len(), None),
    }
}

/// The separator comma after `from` in an array, past whitespace and comments.
fn next_comma(text: &str, from: usize) -> Option<usize> {
    let mut in_comment = false;
    for (i, c) in text[from..].char_indices() {
        match c {
            '\n' => in_comment = false,
            _ if in_comment => {}
            '#' => in_comment = true,
            ',' => return Some(from + i),
            c if c.is_whitespace() => {}
            _ => return None,
        }
    }
    None
}

/// What goes between `,` and a new entry after the entry starting at
/// `start`: a new line with its indentation when it starts its own line, else
/// a space.
fn separator_after(text: &str, start: usize) -> String {
    match own_line_start(text, start) {
        Some(line) => {
            let nl = if text[..line - 1].ends_with('\r') {
                "\r\n"
            } else {
                "\n"
            };
            format!("{nl}{}", &text[line..start])
        }
        None => " ".to_string(),
    }
}

fn validate_import(import: &str) -> Result<(), ConfigError> {
    let reason = if !import.starts_with('/') {
        Some("it is not an absolute path")
    } else if import.ends_with('/') {
        Some("it names a directory, not a file")
    } else if import.chars().any(char::is_control) {
        Some("it has control characters")
    } else if import.contains(['*', '?', '[', '\\']) {
        Some("it has glob characters (`*?[\\`), which containerd would expand")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ConfigError::InvalidImport {
            import: import.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Whether `imports` entry `entry` makes containerd load the file `path`:
/// the same path, or a glob with `*` / `?` in its last component only, over
/// the same directory. Other globs (character classes, wildcard directories)
/// and relative entries count as not covering it: at worst our file is then
/// listed twice.
pub fn covers(entry: &str, path: &str) -> bool {
    if entry == path {
        return true;
    }
    let (Some((edir, ebase)), Some((dir, base))) = (entry.rsplit_once('/'), path.rsplit_once('/'))
    else {
        return false;
    };
    if edir != dir || ebase.contains(['[', '\\']) {
        return false;
    }
    let p: Vec<char> = ebase.chars().collect();
    let s: Vec<char> = base.chars().collect();
    wildcard_match(&p, &s)
}

/// `*` any run of characters, `?` any one; `s` has no `/` here.
fn wildcard_match(p: &[char], s: &[char]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, si));
                pi += 1;
            }
            Some(&c) if c == '?' || c == s[si] => {
                pi += 1;
                si += 1;
            }
            _ => match star {
                // Let the last `*` take one more character and retry.
                Some((sp, ss)) => {
                    star = Some((sp, ss + 1));
                    pi = sp + 1;
                    si = ss + 1;
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

fn imports_array(item: &Item) -> Result<&Array, ConfigError> {
    item.as_array().ok_or(ConfigError::WrongType {
        what: WHAT,
        key: "imports".into(),
        expected: "an array of paths",
        found: item_kind(item),
    })
}

/// A TOML basic string holding `s`.
fn toml_string(s: &str) -> String {
    Value::from(s).to_string()
}

fn span(r: Option<Range<usize>>, key: &'static str) -> Result<Range<usize>, ConfigError> {
    r.ok_or(ConfigError::Unlocatable { what: WHAT, key })
}

fn value_kind(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Boolean(_) => "a boolean",
        Value::Datetime(_) => "a datetime",
        Value::Array(_) => "an array",
        Value::InlineTable(_) => "an inline table",
    }
}

fn item_kind(item: &Item) -> &'static str {
    match item {
        Item::Value(v) => value_kind(v),
        Item::Table(_) => "a table",
        Item::ArrayOfTables(_) => "an array of tables",
        Item::None => "nothing",
    }
}

fn parse_spanned(text: &str) -> Result<Document<&str>, ConfigError> {
    Document::parse(text).map_err(|e| parse_error(WHAT, text, &e))
}

fn parse_mut(text: &str) -> Result<DocumentMut, ConfigError> {
    text.parse::<DocumentMut>()
        .map_err(|e| parse_error(WHAT, text, &e))
}

fn version_of(root: &Table) -> Result<ConfigVersion, ConfigError> {
    match root.get("version") {
        None if root.is_empty() => Ok(ConfigVersion::V2),
        None => Ok(ConfigVersion::V1),
        Some(item) => match item.as_integer() {
            Some(1) => Ok(ConfigVersion::V1),
            Some(2) => Ok(ConfigVersion::V2),
            Some(3) => Ok(ConfigVersion::V3),
            _ => Err(ConfigError::UnsupportedVersion {
                found: echo::clipped(
                    item.as_value()
                        .map(|v| v.to_string())
                        .unwrap_or_else(|| item_kind(item).into())
                        .trim(),
                )
                .to_string(),
            }),
        },
    }
}

fn version1(root: &Table) -> ConfigError {
    ConfigError::Version1 {
        first_key: echo::clipped(root.iter().next().map_or("", |(k, _)| k)).to_string(),
    }
}

fn dotted(path: &[&str]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|p| toml_edit::Key::new(*p).display_repr().into_owned())
        .collect();
    echo::clipped(&parts.join(".")).to_string()
}

fn wrong_table(path: &[&str], found: &Item) -> ConfigError {
    ConfigError::WrongType {
        what: WHAT,
        key: dotted(path),
        expected: "a table",
        found: item_kind(found),
    }
}

/// A copy of the table at `path[depth..]` below `here`, inline tables turned
/// into tables.
fn lookup(here: &Table, path: &[&str], depth: usize) -> Result<Option<Table>, ConfigError> {
    let Some(key) = path.get(depth) else {
        return Ok(Some(here.clone()));
    };
    match here.get(key) {
        None => Ok(None),
        Some(Item::Table(t)) => lookup(t, path, depth + 1),
        Some(Item::Value(Value::InlineTable(t))) => {
            lookup(&t.clone().into_table(), path, depth + 1)
        }
        Some(other) => Err(wrong_table(&path[..=depth], other)),
    }
}

/// One formatting for the whole copy: header tables only (dotted keys and
/// inline tables become `[...]` tables), default spacing and quoting, no
/// comments, so the drop-in reads the same whatever the user's style.
fn normalize_table(t: &mut Table) {
    t.decor_mut().clear();
    if t.is_dotted() {
        t.set_dotted(false);
        // Shown only if it holds keys of its own.
        t.set_implicit(true);
    }
    for (mut key, item) in t.iter_mut() {
        key.fmt();
        normalize_item(item);
    }
}

fn normalize_item(item: &mut Item) {
    if matches!(item, Item::Value(Value::InlineTable(_)))
        && let Item::Value(Value::InlineTable(inline)) = std::mem::take(item)
    {
        *item = Item::Table(inline.into_table());
    }
    match item {
        Item::Table(t) => normalize_table(t),
        Item::ArrayOfTables(a) => a.iter_mut().for_each(normalize_table),
        Item::Value(v) => normalize_value(v),
        Item::None => {}
    }
}

fn normalize_value(v: &mut Value) {
    match v {
        Value::String(f) => f.fmt(),
        Value::Integer(f) => f.fmt(),
        Value::Float(f) => f.fmt(),
        Value::Boolean(f) => f.fmt(),
        Value::Datetime(f) => f.fmt(),
        Value::Array(a) => {
            a.iter_mut().for_each(normalize_value);
            a.set_trailing_comma(false);
            a.set_trailing("");
            a.fmt();
        }
        Value::InlineTable(t) => {
            for (mut key, v) in t.iter_mut() {
                key.fmt();
                normalize_value(v);
            }
            t.set_trailing_comma(false);
            t.set_trailing("");
            t.fmt();
        }
    }
    v.decor_mut().clear();
}

/// The config's `cdi_spec_dirs` (containerd's defaults when it has none) with
/// `ours` appended where missing.
fn merged_spec_dirs(cri: &Table, path: &[&str], ours: &[String]) -> Result<Array, ConfigError> {
    let wrong = |found| ConfigError::WrongType {
        what: WHAT,
        key: dotted(&[path, &["cdi_spec_dirs"]].concat()),
        expected: "an array of directories (strings)",
        found,
    };
    let mut dirs: Vec<String> = match cri.get("cdi_spec_dirs") {
        None => DEFAULT_CDI_SPEC_DIRS
            .iter()
            .map(|d| d.to_string())
            .collect(),
        Some(item) => {
            let arr = item.as_array().ok_or_else(|| wrong(item_kind(item)))?;
            arr.iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| wrong(value_kind(v)))
                })
                .collect::<Result<_, _>>()?
        }
    };
    for d in ours {
        if !dirs.iter().any(|x| same_dir(x, d)) {
            dirs.push(d.clone());
        }
    }
    Ok(dirs.iter().map(String::as_str).collect())
}

/// Two spellings of one directory (a trailing `/` aside).
fn same_dir(a: &str, b: &str) -> bool {
    let trim = |s: &str| {
        let t = s.trim_end_matches('/');
        if t.is_empty() { "/" } else { t }.to_string()
    };
    trim(a) == trim(b)
}

/// Whether a runtime is a plain runc-shim one that a copy can be based on
/// (kata, gVisor and the like are not).
fn is_low_level(rt: &Table) -> bool {
    match rt.get("runtime_type") {
        None => true,
        Some(t) => t.as_str().is_some_and(|t| t.is_empty() || t == RUNC_V2),
    }
}

/// The runtime the handler copies: the default runtime unless it is NVIDIA's
/// (or the handler itself), then `runc`, then `crun`.
fn base_runtime(cri: &Table, handler: &str) -> Option<Table> {
    let containerd = cri.get("containerd")?.as_table()?;
    let runtimes = containerd.get("runtimes")?.as_table()?;
    let default = containerd
        .get("default_runtime_name")
        .and_then(Item::as_str);
    let candidates = default
        .filter(|d| !d.starts_with("nvidia"))
        .into_iter()
        .chain(["runc", "crun"])
        .filter(|c| *c != handler);
    candidates
        .filter_map(|c| runtimes.get(c)?.as_table())
        .find(|t| is_low_level(t))
        .cloned()
}

/// Drops a copied `BinaryName` that points at an NVIDIA binary (a shim left
/// by an earlier toolkit): the handler is plain runc.
fn scrub_shim(rt: &mut Table) {
    if let Some(options) = rt.get_mut("options").and_then(Item::as_table_mut) {
        let is_nvidia = options
            .get("BinaryName")
            .and_then(Item::as_str)
            .is_some_and(|b| {
                b.rsplit('/')
                    .next()
                    .is_some_and(|f| f.starts_with("nvidia"))
            });
        if is_nvidia {
            options.remove("BinaryName");
        }
    }
}

fn child_table<'a>(
    parent: &'a mut Table,
    key: &str,
    path: &[&str],
) -> Result<&'a mut Table, ConfigError> {
    let item = parent.entry(key).or_insert_with(|| {
        let mut t = Table::new();
        t.set_implicit(true);
        Item::Table(t)
    });
    match item {
        Item::Table(t) => Ok(t),
        other => Err(wrong_table(path, other)),
    }
}

fn add_handler(cri: &mut Table, path: &[&str], handler: &str) -> Result<(), ConfigError> {
    let mut rt = base_runtime(cri, handler).unwrap_or_default();
    rt.set_implicit(false);
    let has_type = rt
        .get("runtime_type")
        .and_then(Item::as_str)
        .is_some_and(|t| !t.is_empty());
    if !has_type {
        rt.insert("runtime_type", toml_edit::value(RUNC_V2));
    }
    scrub_shim(&mut rt);
    let containerd_path = [path, &["containerd"]].concat();
    let containerd = child_table(cri, "containerd", &containerd_path)?;
    let default_is_runc = containerd
        .get("default_runtime_name")
        .and_then(Item::as_str)
        .is_none_or(|d| d == "runc");
    let runtimes = child_table(
        containerd,
        "runtimes",
        &[&containerd_path[..], &["runtimes"]].concat(),
    )?;
    // containerd decodes a drop-in's `runtimes` into a fresh map: the built-in
    // `runc` runtime is gone unless the drop-in names it, and with it the
    // default runtime of every pod.
    if default_is_runc && !runtimes.contains_key("runc") {
        let mut runc = Table::new();
        runc.insert("runtime_type", toml_edit::value(RUNC_V2));
        runtimes.insert("runc", Item::Table(runc));
    }
    runtimes.insert(handler, Item::Table(rt));
    Ok(())
}

fn number_tables(t: &mut Table, next: &mut isize) {
    t.set_position(Some(*next));
    *next += 1;
    for (_, item) in t.iter_mut() {
        match item {
            Item::Table(sub) => number_tables(sub, next),
            Item::ArrayOfTables(a) => a.iter_mut().for_each(|sub| number_tables(sub, next)),
            Item::Value(_) | Item::None => {}
        }
    }
}

/// Something the running containerd lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gap {
    /// CDI is off: the CRI plugin ignores CDI device requests.
    CdiDisabled,
    /// CDI specs in this directory are not read.
    SpecDirMissing(String),
    /// No runtime handler of this name.
    RuntimeHandlerMissing(String),
}

impl fmt::Display for Gap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Gap::CdiDisabled => f.write_str(
                "the running containerd has CDI turned off (enableCDI is not true in its CRI config), so it ignores CDI device requests",
            ),
            Gap::SpecDirMissing(dir) => write!(
                f,
                "the running containerd does not read CDI specs from {}: it is not among its cdiSpecDirs",
                echo::quoted(dir)
            ),
            Gap::RuntimeHandlerMissing(h) => write!(
                f,
                "the running containerd has no runtime handler {}, so pods of a RuntimeClass with that handler cannot start",
                echo::quoted(h)
            ),
        }
    }
}

/// What the running containerd lacks, from the CRI Status verbose
/// `info["config"]` JSON (containerd 1.7 and 2.x). Empty: nothing to do.
/// Runtimes are read from `containerd.runtimes` (or a top-level `runtimes`);
/// a config without either has no handlers.
pub fn effective_gaps(config_json: &str, opts: &RuntimeOptions) -> Result<Vec<Gap>, ConfigError> {
    use serde_json::Value as J;
    let bad = |reason: String| ConfigError::EffectiveConfig {
        reason: echo::clipped(&reason).to_string(),
    };
    let kind = |v: &J| match v {
        J::Null => "null",
        J::Bool(_) => "a boolean",
        J::Number(_) => "a number",
        J::String(_) => "a string",
        J::Array(_) => "an array",
        J::Object(_) => "an object",
    };
    let json: J =
        serde_json::from_str(config_json).map_err(|e| bad(format!("it is not JSON ({e})")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad(format!("it is {}, not a JSON object", kind(&json))))?;

    let mut gaps = Vec::new();
    match obj.get("enableCDI") {
        Some(J::Bool(true)) => {}
        // containerd 2.4 removed the switch: CDI is always on there, and its
        // configuration still lists the spec directories.
        None if obj.contains_key("cdiSpecDirs") => {}
        None | Some(J::Null) | Some(J::Bool(false)) => gaps.push(Gap::CdiDisabled),
        Some(other) => return Err(bad(format!("enableCDI is {}, not a boolean", kind(other)))),
    }
    let dirs: Vec<&str> = match obj.get("cdiSpecDirs") {
        None | Some(J::Null) => Vec::new(),
        Some(J::Array(a)) => a
            .iter()
            .map(|d| {
                d.as_str()
                    .ok_or_else(|| bad(format!("cdiSpecDirs holds {}, not a string", kind(d))))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(bad(format!("cdiSpecDirs is {}, not an array", kind(other)))),
    };
    for d in &opts.cdi_spec_dirs {
        if !dirs.iter().any(|x| same_dir(x, d)) {
            gaps.push(Gap::SpecDirMissing(d.clone()));
        }
    }
    if let Some(h) = opts.handler() {
        let runtimes = obj
            .get("containerd")
            .and_then(|c| c.get("runtimes"))
            .or_else(|| obj.get("runtimes"));
        let present = match runtimes {
            None | Some(J::Null) => false,
            Some(J::Object(m)) => m.contains_key(h),
            Some(other) => {
                return Err(bad(format!(
                    "containerd.runtimes is {}, not an object",
                    kind(other)
                )));
            }
        };
        if !present {
            gaps.push(Gap::RuntimeHandlerMissing(h.to_string()));
        }
    }
    Ok(gaps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert_eq!(detect_version(None), Ok(ConfigVersion::V2));
        assert_eq!(detect_version(Some("")), Ok(ConfigVersion::V2));
        assert_eq!(
            detect_version(Some("# only a comment\n\n")),
            Ok(ConfigVersion::V2)
        );
        assert_eq!(detect_version(Some("version = 2\n")), Ok(ConfigVersion::V2));
        assert_eq!(
            detect_version(Some("version = 3\n[plugins]\n")),
            Ok(ConfigVersion::V3)
        );
        assert_eq!(
            detect_version(Some("[plugins.cri]\nx = 1\n")),
            Ok(ConfigVersion::V1)
        );
        assert_eq!(
            detect_version(Some("root = \"/var/lib/containerd\"\n")),
            Ok(ConfigVersion::V1)
        );
        let err = detect_version(Some("version = 4\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`version = 4`"), "{err}");
        let err = detect_version(Some("version = \"2\"\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`version = \"2\"`"), "{err}");
        let err = detect_version(Some("version = 2\n[plugins\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2, column"), "{err}");
        assert_eq!(
            cri_table_path(ConfigVersion::V3),
            ["plugins", "io.containerd.cri.v1.runtime"]
        );
    }

    #[test]
    fn containerd_2_4_without_the_cdi_switch_has_cdi_on() {
        let opts = RuntimeOptions {
            cdi_spec_dirs: vec!["/var/run/cdi".into()],
            runtime_handler: None,
        };
        let always_on = r#"{"cdiSpecDirs": ["/etc/cdi", "/var/run/cdi"]}"#;
        assert_eq!(effective_gaps(always_on, &opts), Ok(vec![]));
        assert_eq!(effective_gaps("{}", &opts).unwrap()[0], Gap::CdiDisabled);
    }

    #[test]
    fn containerd_releases_are_checked_against_the_config_version() {
        for v in ["v2.3.7", "2.4.2", "v2.0.0", "v2.9.1", "1.7.35"] {
            assert_eq!(check_containerd(v, ConfigVersion::V2), Ok(()), "{v}");
        }
        assert_eq!(check_containerd("v2.3.7", ConfigVersion::V3), Ok(()));
        let err = check_containerd("1.7.35", ConfigVersion::V3)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"1.7.35\"") && err.contains("version 2 config"),
            "{err}"
        );
        let err = check_containerd("1.6.20", ConfigVersion::V2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("before 1.7") && err.ends_with("nothing was changed"),
            "{err}"
        );
        let err = check_containerd("v3.0.0", ConfigVersion::V3)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"v3.0.0\"") && err.contains("new major"),
            "{err}"
        );
        let err = check_containerd(&"x".repeat(1000), ConfigVersion::V2)
            .unwrap_err()
            .to_string();
        assert!(err.len() < 500, "{err}");
    }

    #[test]
    fn version1_is_an_error_with_the_fix() {
        let v1 = "[plugins.cri]\n  sandbox_image = \"k8s.gcr.io/pause:3.2\"\n";
        let opts = RuntimeOptions::default();
        for err in [
            render_drop_in(Some(v1), &opts).unwrap_err(),
            add_import(Some(v1), "/etc/containerd/conf.d/x.toml").unwrap_err(),
        ] {
            let msg = err.to_string();
            assert!(msg.contains("version 1 schema"), "{msg}");
            assert!(msg.contains("starts with `plugins`"), "{msg}");
            assert!(msg.contains("containerd config migrate"), "{msg}");
            assert!(msg.contains("add `version = 2`"), "{msg}");
        }
    }

    #[test]
    fn globs() {
        let p = "/etc/containerd/conf.d/99-gpu-stack.toml";
        for yes in [
            p,
            "/etc/containerd/conf.d/*.toml",
            "/etc/containerd/conf.d/*",
            "/etc/containerd/conf.d/??-*.toml",
            "/etc/containerd/conf.d/*gpu*",
        ] {
            assert!(covers(yes, p), "{yes}");
        }
        for no in [
            "/etc/containerd/*.toml",
            "/etc/containerd/*/99-gpu-stack.toml",
            "/etc/containerd/conf.d/*.conf",
            "/etc/containerd/conf.d/?.toml",
            "/etc/containerd/conf.d/[0-9]*.toml",
            "conf.d/*.toml",
            "",
        ] {
            assert!(!covers(no, p), "{no}");
        }
        let chars = |s: &str| s.chars().collect::<Vec<_>>();
        assert!(wildcard_match(&chars("a*b*c"), &chars("aXbYbZc")));
        assert!(!wildcard_match(&chars("a*b*c"), &chars("aXbYbZ")));
        assert!(wildcard_match(&chars("**"), &chars("")));
    }

    #[test]
    fn bad_imports_are_refused() {
        for bad in [
            "conf.d/x.toml",
            "/etc/containerd/conf.d/",
            "/etc/x*.toml",
            "/etc/x\n.toml",
        ] {
            assert!(
                matches!(
                    add_import(None, bad),
                    Err(ConfigError::InvalidImport { .. })
                ),
                "{bad:?}"
            );
        }
        let err = add_import(Some("version = 2\nimports = \"/x.toml\"\n"), "/y.toml").unwrap_err();
        assert!(
            err.to_string()
                .contains("`imports` in the containerd config is a string"),
            "{err}"
        );
        let err = add_import(Some("version = 2\nimports = [1]\n"), "/y.toml").unwrap_err();
        assert!(err.to_string().contains("is an integer"), "{err}");
    }

    #[test]
    fn imports_edits_by_shape() {
        let i = "/d/x.toml";
        let cases = [
            ("version = 2\n", "version = 2\nimports = [\"/d/x.toml\"]\n"),
            ("version = 2", "version = 2\nimports = [\"/d/x.toml\"]"),
            (
                "version = 2 # v\r\n[a]\r\n",
                "version = 2 # v\r\nimports = [\"/d/x.toml\"]\r\n[a]\r\n",
            ),
            (
                "version = 2\nimports = []\n",
                "version = 2\nimports = [\"/d/x.toml\"]\n",
            ),
            (
                "imports = [ ]\nversion = 2\n",
                "imports = [\"/d/x.toml\" ]\nversion = 2\n",
            ),
            (
                "version = 2\nimports = ['/a']\n",
                "version = 2\nimports = ['/a', \"/d/x.toml\"]\n",
            ),
            (
                "version = 2\nimports = [\n    \"/a\", # a\n    \"/b\",\n]\n",
                "version = 2\nimports = [\n    \"/a\", # a\n    \"/b\",\n    \"/d/x.toml\",\n]\n",
            ),
            (
                "version = 2\nimports = [\n\t'/a' # a\r\n  # '/off',\n]\n",
                "version = 2\nimports = [\n\t'/a', # a\r\n\t\"/d/x.toml\"\r\n  # '/off',\n]\n",
            ),
            (
                "version = 2\nimports = [\"/a\",\n           \"/b\"]\n",
                "version = 2\nimports = [\"/a\",\n           \"/b\",\n           \"/d/x.toml\"]\n",
            ),
            (
                "version = 2\nimports = [\"/a\", \"/b\", # ab\n]\n",
                "version = 2\nimports = [\"/a\", \"/b\", \"/d/x.toml\", # ab\n]\n",
            ),
            (
                "# c\n\n",
                "version = 2 # added by gpu-stack's toolkit agent with `imports`\nimports = [\"/d/x.toml\"]\n# c\n\n",
            ),
            (
                "",
                "version = 2 # added by gpu-stack's toolkit agent with `imports`\nimports = [\"/d/x.toml\"]\n",
            ),
        ];
        for (before, after) in cases {
            let added = add_import(Some(before), i).unwrap();
            assert_eq!(added.as_deref(), Some(after), "{before:?}");
            assert_eq!(add_import(Some(after), i).unwrap(), None, "{after:?}");
            let had_key = before.contains("imports");
            assert_eq!(
                remove_import(after, i, !had_key).unwrap(),
                before,
                "{after:?}"
            );
        }
        assert_eq!(
            add_import(None, i).unwrap().as_deref(),
            Some("version = 2\nimports = [\"/d/x.toml\"]\n")
        );
    }

    #[test]
    fn removal_of_entries_the_user_moved() {
        let i = "/d/x.toml";
        let cases = [
            (
                "imports = [\"/d/x.toml\", \"/a\"]\n",
                "imports = [\"/a\"]\n",
            ),
            (
                "imports = [\n  \"/d/x.toml\",\n  \"/a\",\n]\n",
                "imports = [\n  \"/a\",\n]\n",
            ),
            ("imports = [\"/d/x.toml\", ]\n", "imports = [ ]\n"),
            (
                "imports = [\"/a\", \"/d/x.toml\", \"/b\", \"/d/x.toml\"]\n",
                "imports = [\"/a\", \"/b\"]\n",
            ),
            (
                "imports = [\"/a\" # keep\n, \"/d/x.toml\"]\n",
                "imports = [\"/a\" # keep\n]\n",
            ),
            (
                "version = 2\nimports = [\"/a\"]\n",
                "version = 2\nimports = [\"/a\"]\n",
            ),
            (
                "imports = [\n  \"/d/x.toml\" # ours\n]\n",
                "imports = [\n]\n",
            ),
            (
                "imports = [\n  \"/d/x.toml\"\n  , \"/a\"]\n",
                "imports = [\n  \"/a\"]\n",
            ),
            (
                "imports = [\n  \"/a\" , # a\n  \"/d/x.toml\"\n]\n",
                "imports = [\n  \"/a\"  # a\n]\n",
            ),
        ];
        for (before, after) in cases {
            let got = remove_import(before, i, false).unwrap();
            assert_eq!(got, after, "{before:?}");
            assert!(got.parse::<DocumentMut>().is_ok(), "{got:?}");
        }
        // The key goes only when asked, and then takes its whole line.
        let t = "version = 2\n  imports = [\"/d/x.toml\"] # ours\n[a]\n";
        assert_eq!(remove_import(t, i, true).unwrap(), "version = 2\n[a]\n");
        assert_eq!(
            remove_import(t, i, false).unwrap(),
            "version = 2\n  imports = [] # ours\n[a]\n"
        );
        // A version line the user's file had stays.
        let t = "version = 2\nimports = [\"/d/x.toml\"]\n";
        assert_eq!(remove_import(t, i, true).unwrap(), "version = 2\n");
        // Ours goes only while the file is otherwise empty.
        let t = format!("{ADDED_VERSION_LINE}imports = [\"/d/x.toml\"]\n[grpc]\n");
        assert_eq!(
            remove_import(&t, i, true).unwrap(),
            format!("{ADDED_VERSION_LINE}[grpc]\n")
        );
    }

    #[test]
    fn drop_in_without_main_config() {
        let opts = RuntimeOptions {
            cdi_spec_dirs: vec!["/var/run/cdi".into(), "/run/extra-cdi/".into()],
            runtime_handler: Some("nvidia".into()),
        };
        let text = render_drop_in(None, &opts).unwrap();
        let body = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(
            body,
            "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"]\nenable_cdi = true\n\
             cdi_spec_dirs = [\"/etc/cdi\", \"/var/run/cdi\", \"/run/extra-cdi/\"]\n\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n\
             runtime_type = \"io.containerd.runc.v2\"\n\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia]\n\
             runtime_type = \"io.containerd.runc.v2\""
        );
        assert_eq!(
            text,
            render_drop_in(Some("# nothing yet\n"), &opts).unwrap()
        );
        // No handler: runtimes are not touched at all.
        let plain = RuntimeOptions {
            runtime_handler: None,
            ..opts.clone()
        };
        assert!(!render_drop_in(None, &plain).unwrap().contains("runtimes"));
        // Another default runtime: runc is not invented.
        let crun = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"crun\"\n\
                    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crun]\nruntime_type = \"io.containerd.runc.v2\"\n";
        let text = render_drop_in(Some(crun), &opts).unwrap();
        assert!(!text.contains("runtimes.runc"), "{text}");
        assert!(text.contains("runtimes.crun]"), "{text}");
    }

    #[test]
    fn handler_base_runtime_choice() {
        let opts = RuntimeOptions {
            cdi_spec_dirs: vec![],
            runtime_handler: Some("nvidia".into()),
        };
        let cfg = |default: &str| {
            format!(
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"{default}\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia]\nruntime_type = \"io.containerd.runc.v2\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia.options]\nBinaryName = \"/usr/bin/nvidia-container-runtime\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.kata]\nruntime_type = \"io.containerd.kata.v2\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crun]\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crun.options]\nBinaryName = \"/usr/bin/crun\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.mine]\nruntime_type = \"\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.mine.options]\nSystemdCgroup = true\n"
            )
        };
        let handler_of = |text: &str| {
            let doc: DocumentMut = text.parse().unwrap();
            doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"].clone()
        };
        // The default runtime when it is a plain one; runtime_type filled in.
        let h = handler_of(&render_drop_in(Some(&cfg("mine")), &opts).unwrap());
        assert_eq!(h["runtime_type"].as_str(), Some(RUNC_V2));
        assert_eq!(h["options"]["SystemdCgroup"].as_bool(), Some(true));
        // NVIDIA's default and kata do not count; crun does, BinaryName kept.
        for default in ["nvidia", "kata"] {
            let h = handler_of(&render_drop_in(Some(&cfg(default)), &opts).unwrap());
            assert_eq!(
                h["options"]["BinaryName"].as_str(),
                Some("/usr/bin/crun"),
                "{default}"
            );
        }
        // Only NVIDIA's own runtime: nothing to copy from but its shim is dropped.
        let only = "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd]\ndefault_runtime_name = 'nvidia'\n\
                    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\nruntime_type = 'io.containerd.runc.v2'\n\
                    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]\nBinaryName = '/usr/local/nvidia/toolkit/nvidia-container-runtime'\nSystemdCgroup = true\n";
        let text = render_drop_in(Some(only), &opts).unwrap();
        let doc: DocumentMut = text.parse().unwrap();
        let cri = &doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"];
        assert_eq!(
            cri["default_runtime_name"].as_str(),
            Some("nvidia"),
            "the default is the user's"
        );
        let h = &cri["runtimes"]["nvidia"];
        assert!(h["options"].get("BinaryName").is_none(), "{text}");
        assert_eq!(h["options"]["SystemdCgroup"].as_bool(), Some(true));
    }

    #[test]
    fn dotted_and_inline_tables_become_headers() {
        let main = "version = 2\n[plugins]\n\"io.containerd.grpc.v1.cri\" = { sandbox_image = 'p:1', containerd = { runtimes = { runc = { options = { SystemdCgroup = true } } } } }\n";
        let opts = RuntimeOptions {
            cdi_spec_dirs: vec!["/var/run/cdi".into()],
            runtime_handler: Some("gpu".into()),
        };
        let text = render_drop_in(Some(main), &opts).unwrap();
        assert!(text.contains("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\nSystemdCgroup = true\n"), "{text}");
        assert!(text.contains("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpu.options]\nSystemdCgroup = true\n"), "{text}");
        assert!(text.contains("sandbox_image = \"p:1\""), "{text}");
        let dotted = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\ncontainerd.snapshotter = \"zfs\"\ncontainerd.runtimes.runc.runtime_type = \"io.containerd.runc.v2\"\n";
        let text = render_drop_in(Some(dotted), &opts).unwrap();
        assert!(
            text.contains(
                "[plugins.\"io.containerd.grpc.v1.cri\".containerd]\nsnapshotter = \"zfs\"\n"
            ),
            "{text}"
        );
        let doc: DocumentMut = text.parse().unwrap();
        assert_eq!(doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["gpu"]["runtime_type"].as_str(), Some(RUNC_V2));
    }

    #[test]
    fn wrong_types_in_the_cri_table() {
        let opts = RuntimeOptions {
            cdi_spec_dirs: vec!["/var/run/cdi".into()],
            runtime_handler: Some("nvidia".into()),
        };
        let cases = [
            (
                "version = 2\nplugins = 3\n",
                "`plugins` in the containerd config is an integer, but containerd expects a table",
            ),
            (
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\ncdi_spec_dirs = \"/etc/cdi\"\n",
                "`plugins.\"io.containerd.grpc.v1.cri\".cdi_spec_dirs` in the containerd config is a string",
            ),
            (
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\ncontainerd = 1\n",
                "`plugins.\"io.containerd.grpc.v1.cri\".containerd` in the containerd config is an integer",
            ),
        ];
        for (main, want) in cases {
            let err = render_drop_in(Some(main), &opts).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn has_imports_sees_only_a_top_level_key() {
        assert!(!has_imports(None));
        assert!(!has_imports(Some("version = 2\n")));
        assert!(has_imports(Some("version = 2\nimports = []\n")));
        assert!(!has_imports(Some("[plugins]\nimports = [\"x\"]\n")));
    }
}
