//! How berth quotes what users give it in one-line errors: values elided, lists cut short,
//! control characters refused in what is shown on a line (names, labels, variables) and escaped
//! in every error line.

/// Longest user-given value an error line quotes whole: a longer one is cut in the middle.
pub const ELIDE_AT: usize = 120;

/// A value the user gave, as an error line quotes it: whole when short, else its start and end
/// around the number of bytes left out, so a 100 KB argument gives one readable line.
pub fn elide(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= ELIDE_AT {
        return std::borrow::Cow::Borrowed(text);
    }
    let cut = |at: usize, forward: bool| {
        let mut i = at;
        while !text.is_char_boundary(i) {
            if forward { i += 1 } else { i -= 1 }
        }
        i
    };
    let head = cut(ELIDE_AT / 2, false);
    let tail = cut(text.len() - ELIDE_AT / 4, true);
    std::borrow::Cow::Owned(format!(
        "{}…[{} bytes]…{}",
        &text[..head],
        tail - head,
        &text[tail..]
    ))
}

/// Items an error line lists before saying how many more there are.
pub const LIST_AT: usize = 8;

/// Longest error line berth prints (bytes, before escaping): a longer one is cut in the middle.
pub const LINE_MAX: usize = 2048;

/// `items` as an error line lists them: the first [`LIST_AT`], each [`elide`]d and
/// comma-separated, then "(and N more)"; `none` when there is none. A registry's index with
/// 20000 platforms gives one short line.
pub fn list<T: AsRef<str>>(items: impl IntoIterator<Item = T>, none: &str) -> String {
    let mut shown = Vec::new();
    let mut more = 0usize;
    for item in items {
        if shown.len() < LIST_AT {
            shown.push(elide(item.as_ref()).into_owned());
        } else {
            more += 1;
        }
    }
    match (shown.is_empty(), more) {
        (true, _) => none.to_string(),
        (false, 0) => shown.join(", "),
        (false, n) => format!("{} (and {n} more)", shown.join(", ")),
    }
}

/// The first control character of `text` and its byte offset: a name, label or variable name
/// holding one would start a line of its own where berth or a log shows it (a forged row of
/// `berth ps`, a forged log entry).
pub fn control_char(text: &str) -> Option<(usize, char)> {
    text.char_indices().find(|(_, c)| c.is_control())
}

/// Why `text` (a `what`, such as "--name") is refused when it holds a control character: one
/// line naming the value (escaped), the character and where it is; `None` when it holds none.
pub fn refuse_control(what: &str, text: &str) -> Option<String> {
    let (at, c) = control_char(text)?;
    Some(format!(
        "{what} '{}': has a control character ({}) at byte {at}: names, labels and variable \
         names must be printable, since berth ps and the logs show each on one line",
        escape_controls(&elide(text)),
        c.escape_unicode()
    ))
}

/// `text` with each control character written as its escape (`\n`, `\u{1b}`): what a line
/// shows of a value that must not break it.
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    if control_char(text).is_none() {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// An error message as berth prints it: control characters escaped, then cut to [`LINE_MAX`]
/// bytes around the number left out (its start and its end kept, as [`elide`] does), so that no
/// message, whatever a user or a server put in it, is more than one bounded line on stderr, in
/// slurmd's log or in syslog.
pub fn one_line(message: &str) -> String {
    let text = escape_controls(message);
    if text.len() <= LINE_MAX {
        return text.into_owned();
    }
    let boundary = |at: usize, forward: bool| {
        let mut i = at;
        while !text.is_char_boundary(i) {
            if forward { i += 1 } else { i -= 1 }
        }
        i
    };
    let head = boundary(LINE_MAX * 3 / 4, false);
    let tail = boundary(text.len() - LINE_MAX / 4, true);
    format!(
        "{}…[{} bytes]…{}",
        &text[..head],
        tail - head,
        &text[tail..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_show_a_few_and_say_how_many_more() {
        assert_eq!(list(Vec::<String>::new(), "none"), "none");
        assert_eq!(list(["a", "b"], "none"), "a, b");
        let many: Vec<String> = (0..20_000).map(|i| format!("linux/arch{i}")).collect();
        let line = list(&many, "none");
        assert!(line.starts_with("linux/arch0, linux/arch1, "), "{line}");
        assert!(line.ends_with("linux/arch7 (and 19992 more)"), "{line}");
        assert!(line.len() < 200, "{line}");
        // Each item is elided too: eight 100 KB names stay one short line.
        let long = vec!["x".repeat(100_000); 9];
        let line = list(&long, "none");
        assert!(line.len() < 8 * (ELIDE_AT + 40), "{}", line.len());
        assert!(line.ends_with("(and 1 more)"));
    }

    #[test]
    fn control_characters_are_found_and_refused_in_one_line() {
        assert_eq!(control_char("plain-name_1.2 with space"), None);
        assert_eq!(control_char("x\nforged"), Some((1, '\n')));
        assert_eq!(control_char("tab\there"), Some((3, '\t')));
        assert_eq!(control_char("esc\u{1b}[31m"), Some((3, '\u{1b}')));
        assert_eq!(control_char("del\u{7f}"), Some((3, '\u{7f}')));
        // C1 controls too (a terminal may act on U+009B as on ESC [).
        assert_eq!(control_char("c1\u{9b}"), Some((2, '\u{9b}')));
        assert_eq!(control_char("ünïcödé"), None);
        assert_eq!(refuse_control("--name", "fine"), None);
        let line = refuse_control("--name", "x\nforged").unwrap();
        assert!(!line.contains('\n'), "{line}");
        assert!(line.contains("'x\\nforged'"), "{line}");
        assert!(line.contains("u{a}") && line.contains("byte 1"), "{line}");
    }

    #[test]
    fn error_lines_are_bounded_and_never_break() {
        assert_eq!(one_line("short and plain"), "short and plain");
        assert_eq!(one_line("a\nb\r\u{1b}c"), "a\\nb\\r\\u{1b}c");
        let huge = format!("start {} end", "ä".repeat(200_000));
        let line = one_line(&huge);
        assert!(line.len() <= LINE_MAX + 40, "{}", line.len());
        assert!(line.starts_with("start ") && line.ends_with(" end"));
        assert!(line.contains("bytes]"));
        // Cut after escaping: a message of escapes is bounded the same.
        let escapes = "\u{1b}".repeat(100_000);
        let line = one_line(&escapes);
        assert!(!line.contains('\u{1b}'));
        assert!(line.len() <= LINE_MAX + 40, "{}", line.len());
    }
}
