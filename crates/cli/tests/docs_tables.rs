//! The Markdown tables of README.md and docs/*.md render as tables: each has its
//! `|---|` separator row under the header, and none sits inside a ``` code block (where
//! it would show as text). The README's demo table once had neither.

use std::path::{Path, PathBuf};

fn is_row(line: &str) -> bool {
    let t = line.trim();
    t.len() > 1 && t.starts_with('|') && t.ends_with('|')
}

fn is_separator(line: &str) -> bool {
    let t = line.trim().trim_matches('|');
    !t.is_empty()
        && t.split('|').all(|cell| {
            let c = cell.trim().trim_start_matches(':').trim_end_matches(':');
            c.len() >= 3 && c.bytes().all(|b| b == b'-')
        })
}

/// Problems of `text`'s tables, as "line N: what".
fn table_problems(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut problems = Vec::new();
    let mut in_code = false;
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_start().starts_with("```") {
            in_code = !in_code;
            i += 1;
            continue;
        }
        if !is_row(lines[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < lines.len() && is_row(lines[i]) {
            i += 1;
        }
        let rows = &lines[start..i];
        let has_separator = rows.len() >= 2 && is_separator(rows[1]);
        if in_code && rows.len() >= 2 {
            problems.push(format!(
                "line {}: a table inside a ``` code block does not render",
                start + 1
            ));
        } else if !in_code && !has_separator {
            problems.push(format!(
                "line {}: a table without its |---| row under the header",
                start + 1
            ));
        }
    }
    problems
}

fn markdown_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    files
}

#[test]
fn tables_render() {
    let mut all = Vec::new();
    for f in markdown_files() {
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        all.extend(
            table_problems(&text)
                .into_iter()
                .map(|p| format!("{}: {p}", f.display())),
        );
    }
    assert!(
        all.is_empty(),
        "tables that do not render:\n  {}",
        all.join("\n  ")
    );
}

#[test]
fn the_checker_sees_both_faults() {
    assert!(table_problems("| a | b |\n| --- | ---: |\n| 1 | 2 |\n").is_empty());
    assert_eq!(table_problems("| a | b |\n| 1 | 2 |\n").len(), 1);
    assert_eq!(
        table_problems("```\n| a | b |\n| --- | --- |\n```\n").len(),
        1
    );
    assert!(table_problems("```sh\nvdstream serve-image FILE | --memory SIZE\n```\n").is_empty());
}
