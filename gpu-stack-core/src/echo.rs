//! Bounded echoes of user input in messages.
//!
//! Error messages name the input that was wrong, but input can be as large as a
//! user makes it (a 100 KB layout string, a config with thousands of entries).
//! Every message that echoes user input goes through one of these helpers, so a
//! message stays a few hundred bytes whatever the input size, and says how much
//! it left out.

use std::fmt;

/// Most characters of one input echoed before the rest is left out.
pub const MAX_ECHO_CHARS: usize = 120;

/// Most items of a list named before the rest are counted instead.
pub const MAX_LIST_ITEMS: usize = 20;

/// `s` quoted like `{:?}` (escapes included), cut after [`MAX_ECHO_CHARS`]
/// characters with a count of the bytes left out.
pub fn quoted(s: &str) -> Quoted<'_> {
    Quoted(s)
}

/// `s` as written, cut after [`MAX_ECHO_CHARS`] characters with a count of the
/// bytes left out.
pub fn clipped(s: &str) -> Clipped<'_> {
    Clipped(s)
}

/// See [`quoted`].
#[derive(Debug, Clone, Copy)]
pub struct Quoted<'a>(&'a str);

/// See [`clipped`].
#[derive(Debug, Clone, Copy)]
pub struct Clipped<'a>(&'a str);

/// The kept prefix of `s` and how many bytes follow it.
fn split(s: &str) -> (&str, usize) {
    match s.char_indices().nth(MAX_ECHO_CHARS) {
        Some((at, _)) => (&s[..at], s.len() - at),
        None => (s, 0),
    }
}

fn left_out(f: &mut fmt::Formatter<'_>, bytes: usize) -> fmt::Result {
    if bytes > 0 {
        write!(f, "… ({bytes} more bytes left out)")?;
    }
    Ok(())
}

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (head, rest) = split(self.0);
        write!(f, "{head:?}")?;
        left_out(f, rest)
    }
}

impl fmt::Display for Clipped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (head, rest) = split(self.0);
        f.write_str(head)?;
        left_out(f, rest)
    }
}

/// The items joined with `", "`, at most [`MAX_LIST_ITEMS`] of them, then
/// `", ... and K more"`. Each item is itself clipped.
pub fn join_capped<T: fmt::Display>(items: &[T]) -> String {
    join_capped_at(items, MAX_LIST_ITEMS)
}

/// [`join_capped`] naming at most `max` items: for lists a reader picks from
/// (the config names of a file), where a longer list helps.
pub fn join_capped_at<T: fmt::Display>(items: &[T], max: usize) -> String {
    let mut out = String::new();
    for (i, item) in items.iter().take(max).enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&clipped(&item.to_string()).to_string());
    }
    if items.len() > max {
        out.push_str(&format!(", ... and {} more", items.len() - max));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn short_input_is_echoed_whole() {
        assert_eq!(quoted("3g.40gb@4").to_string(), "\"3g.40gb@4\"");
        assert_eq!(clipped("3g.40gb@4").to_string(), "3g.40gb@4");
        assert_eq!(join_capped(&["a", "b"]), "a, b");
    }

    #[test]
    fn long_input_is_cut_with_a_count() {
        let s = "x".repeat(MAX_ECHO_CHARS + 1000);
        let q = quoted(&s).to_string();
        assert!(q.starts_with(&format!("\"{}\"", "x".repeat(MAX_ECHO_CHARS))));
        assert!(q.ends_with("… (1000 more bytes left out)"), "{q}");
        let items: Vec<u32> = (0..100).collect();
        let j = join_capped(&items);
        assert!(j.ends_with("19, ... and 80 more"), "{j}");
    }

    proptest! {
        /// Whatever the input, an echo is bounded and keeps a prefix of it.
        #[test]
        fn echoes_are_bounded(s in ".{0,600}", n in 0usize..200, len in 0usize..400) {
            let c = clipped(&s).to_string();
            prop_assert!(c.chars().count() <= MAX_ECHO_CHARS + 40);
            let (head, _) = split(&s);
            prop_assert!(c.starts_with(head));
            prop_assert!(s.starts_with(head));
            // Debug escapes grow a char to at most 10 bytes (`\u{10ffff}`).
            prop_assert!(quoted(&s).to_string().len() <= 10 * MAX_ECHO_CHARS + 40);
            let item = "y".repeat(len);
            let items = vec![item; n];
            prop_assert!(join_capped(&items).len() <= MAX_LIST_ITEMS * (4 * MAX_ECHO_CHARS + 40) + 40);
        }
    }
}
