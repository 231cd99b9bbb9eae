//! What the commands print, shared: fixed-width tables and `name: value` fields.

/// A table: each column but the last padded to its width, one space apart; the last column
/// unpadded. A header row first.
pub fn table<const N: usize, const W: usize>(
    header: [&str; N],
    widths: [usize; W],
    rows: impl IntoIterator<Item = [String; N]>,
) -> String {
    let mut out = String::new();
    let mut row = |cells: &[&str]| {
        for (i, cell) in cells.iter().enumerate() {
            match widths.get(i) {
                Some(w) => out.push_str(&format!("{cell:<w$} ")),
                None => out.push_str(cell),
            }
        }
        out.push('\n');
    };
    row(&header);
    for r in rows {
        row(&r.each_ref().map(String::as_str));
    }
    out
}

/// One `name: value` line, the names aligned.
pub fn field(name: &str, value: &str) -> String {
    format!("{:<12} {}", format!("{name}:"), value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_pads_every_column_but_the_last() {
        let t = table(["ID", "NAME"], [4], [["k1".to_owned(), "a b".to_owned()]]);
        assert_eq!(t, "ID   NAME\nk1   a b\n");
    }
}
