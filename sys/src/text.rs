//! How berth quotes what users give it in one-line errors.

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
