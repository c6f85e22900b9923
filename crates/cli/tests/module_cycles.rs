//! No two files of a crate import each other, directly or in a loop: the file-level graph of
//! module references (`use crate::x::…`, `crate::x::…` in code, `super::…`, a parent's
//! `child::…`) of every crate under `crates/*/src` is acyclic. Code under `#[cfg(test)]` is
//! left out (a test may reach anywhere), and so are a module's references to its own files
//! (`lib.rs`, `main.rs` or `http/mod.rs` declaring and re-exporting its children); a path
//! through a root re-export (`crate::Name` where the root has `pub use x::Name`) counts as a
//! reference to `x`.
//!
//! A failure names the crate, the files of each strongly connected component and one cycle
//! through them, e.g. `store: meta -> merge -> store -> meta`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `text` with comments, string and char literals blanked out (lengths kept).
fn strip_comments_and_literals(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let (mut depth, mut j) = (0usize, i);
                while j < b.len() {
                    if b[j..].starts_with(b"/*") {
                        depth += 1;
                        j += 2;
                    } else if b[j..].starts_with(b"*/") {
                        depth -= 1;
                        j += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        j += 1;
                    }
                }
                blank(&mut out, i, j);
                i = j;
            }
            b'r' if matches!(b.get(i + 1), Some(b'"') | Some(b'#'))
                && (i == 0 || !is_ident(b[i - 1])) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                let start = i + 2 + hashes;
                let end = b[start..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |p| start + p + close.len());
                blank(&mut out, i, end);
                i = end;
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, i, (j + 1).min(b.len()));
                i = j + 1;
            }
            b'\'' => {
                // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
                let end = if b.get(i + 1) == Some(&b'\\') {
                    b[i + 2..]
                        .iter()
                        .position(|&c| c == b'\'')
                        .map(|p| i + 2 + p + 1)
                } else {
                    let len = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                    (b.get(i + 1 + len) == Some(&b'\'')).then_some(i + 2 + len)
                };
                match end {
                    Some(end) => {
                        blank(&mut out, i, end);
                        i = end;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Index just past the `}` that closes the `{` at `open`.
fn block_end(b: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (j, &c) in b.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
    }
    b.len()
}

/// `code` (already stripped) without the items under `#[cfg(test)]`.
fn strip_test_items(code: &str) -> String {
    let mut out = code.as_bytes().to_vec();
    let b = code.as_bytes();
    let mut from = 0;
    while let Some(p) = code[from..].find("#[cfg(test)]") {
        let start = from + p;
        let after = start + "#[cfg(test)]".len();
        let end = match b[after..].iter().position(|&c| c == b'{' || c == b';') {
            Some(q) if b[after + q] == b'{' => block_end(b, after + q),
            Some(q) => after + q + 1,
            None => b.len(),
        };
        for c in &mut out[start..end] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
        from = end;
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

/// Every path in `code` that starts with `crate`, `super`, `self` or a name in `children`,
/// as its segments; `use a::{b::C, d}` gives `a::b::C` and `a::d`.
fn paths(code: &str, children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let b = code.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if !is_ident(b[i])
            || (i > 0 && (is_ident(b[i - 1]) || b[i - 1] == b'$' || b[i - 1] == b':'))
        {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && is_ident(b[i]) {
            i += 1;
        }
        let first = &code[start..i];
        let rooted = matches!(first, "crate" | "super" | "self") || children.contains(first);
        if rooted && code[i..].trim_start().starts_with("::") {
            let end = expand(code, start, &mut Vec::new(), &mut found);
            i = end.max(i);
        }
    }
    found
}

/// Parse a path tree at `at` with `prefix` already read; push complete paths to `out` and
/// return the index where the tree ends.
fn expand(
    code: &str,
    mut at: usize,
    prefix: &mut Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    let b = code.as_bytes();
    let depth = prefix.len();
    let skip_ws = |mut j: usize| {
        while j < b.len() && b[j].is_ascii_whitespace() {
            j += 1;
        }
        j
    };
    loop {
        at = skip_ws(at);
        if at < b.len() && b[at] == b'{' {
            at += 1;
            loop {
                at = skip_ws(at);
                if at >= b.len() || b[at] == b'}' {
                    at += 1;
                    break;
                }
                at = expand(code, at, prefix, out);
                at = skip_ws(at);
                if at < b.len() && b[at] == b',' {
                    at += 1;
                }
            }
            break;
        }
        let s = at;
        while at < b.len() && is_ident(b[at]) {
            at += 1;
        }
        if s == at {
            if b.get(at) == Some(&b'*') {
                at += 1;
            }
            if prefix.len() > depth {
                out.push(prefix.clone());
            }
            break;
        }
        prefix.push(code[s..at].to_string());
        let j = skip_ws(at);
        if code[j..].starts_with("::") && !code[j + 2..].trim_start().starts_with('<') {
            at = j + 2;
            continue;
        }
        out.push(prefix.clone());
        break;
    }
    prefix.truncate(depth);
    at
}

struct Crate {
    name: String,
    /// File modules by path ("" is the root, "http::live" a file under http/).
    files: BTreeMap<String, PathBuf>,
}

fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod"))
        || (parts.len() == 1 && matches!(parts[0].as_str(), "lib" | "main"))
    {
        parts.pop();
    }
    parts.join("::")
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "bin") {
                rs_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn crates(root: &Path) -> Vec<Crate> {
    let mut list = Vec::new();
    for e in std::fs::read_dir(root.join("crates")).unwrap() {
        let dir = e.unwrap().path();
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let mut files = Vec::new();
        rs_files(&src, &mut files);
        let files = files
            .into_iter()
            .map(|f| (module_of(&src, &f), f))
            .collect();
        list.push(Crate {
            name: dir.file_name().unwrap().to_string_lossy().into_owned(),
            files,
        });
    }
    list.sort_by(|a, b| a.name.cmp(&b.name));
    list
}

/// File-level reference graph of a crate: module -> modules it refers to.
fn graph(krate: &Crate) -> BTreeMap<String, BTreeSet<String>> {
    let code: BTreeMap<&String, String> = krate
        .files
        .iter()
        .map(|(m, f)| {
            (
                m,
                strip_test_items(&strip_comments_and_literals(
                    &std::fs::read_to_string(f).unwrap(),
                )),
            )
        })
        .collect();
    let children = |m: &str| -> BTreeSet<String> {
        krate
            .files
            .keys()
            .filter_map(|k| {
                let rest = if m.is_empty() {
                    Some(k.as_str())
                } else {
                    k.strip_prefix(m).and_then(|r| r.strip_prefix("::"))
                };
                rest.filter(|r| !r.is_empty() && !r.contains("::"))
                    .map(str::to_string)
            })
            .collect()
    };
    // Root re-exports: `pub use x::y::Name` makes `crate::Name` a reference to file x::y.
    let mut reexports: BTreeMap<String, Vec<String>> = BTreeMap::new();
    if let Some(root) = code.get(&String::new()) {
        for mut p in paths(root, &children("")) {
            if p.first().is_some_and(|s| s == "crate" || s == "self") {
                p.remove(0);
            }
            if let Some(name) = p.last().cloned() {
                reexports.insert(name, p);
            }
        }
    }
    let mut g = BTreeMap::new();
    for (m, text) in &code {
        if m.is_empty() {
            continue;
        }
        let own: Vec<&str> = m.split("::").collect();
        let mut refs = BTreeSet::new();
        for p in paths(text, &children(m)) {
            // Absolute segments of the path.
            let mut abs: Vec<String> = own.iter().map(|s| s.to_string()).collect();
            let mut rest = p.as_slice();
            match rest[0].as_str() {
                "crate" => {
                    abs.clear();
                    rest = &rest[1..];
                }
                "self" => rest = &rest[1..],
                "super" => {
                    while rest.first().is_some_and(|s| s == "super") {
                        abs.pop();
                        rest = &rest[1..];
                    }
                }
                _ => {} // a child module of this one
            }
            abs.extend(rest.iter().cloned());
            if let Some(target) = abs
                .first()
                .filter(|s| !krate.files.contains_key(*s))
                .and_then(|s| reexports.get(s))
            {
                abs.splice(0..1, target.iter().cloned());
            }
            // The longest prefix that is a file.
            let target = (1..=abs.len())
                .rev()
                .map(|n| abs[..n].join("::"))
                .find(|k| krate.files.contains_key(k));
            // A parent naming its own files (`pub use child::X`) is structure, like the root.
            if let Some(t) = target {
                if t != **m && !t.starts_with(&format!("{m}::")) {
                    refs.insert(t);
                }
            }
        }
        g.insert((*m).clone(), refs);
    }
    g
}

/// Strongly connected components with more than one file (Tarjan).
fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct St<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(s: &mut St<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        for w in s.g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = BTreeSet::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on.remove(w);
                comp.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                s.out.push(comp);
            }
        }
    }
    let mut s = St {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// One cycle through the first file of `comp`, as "a -> b -> a" (breadth-first, shortest).
fn one_cycle(g: &BTreeMap<String, BTreeSet<String>>, comp: &BTreeSet<String>) -> String {
    let start = comp.iter().next().unwrap();
    let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start.as_str()]);
    while let Some(v) = queue.pop_front() {
        for w in &g[v] {
            if !comp.contains(w) {
                continue;
            }
            if w == start {
                let mut path = vec![start.as_str(), v];
                let mut x = v;
                while x != start {
                    x = prev[x];
                    path.push(x);
                }
                path.reverse();
                return path.join(" -> ");
            }
            if !prev.contains_key(w.as_str()) {
                prev.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    unreachable!("a strongly connected component has a cycle")
}

#[test]
fn no_module_import_cycles() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut problems = Vec::new();
    for krate in crates(&root) {
        let g = graph(&krate);
        for comp in cycles(&g) {
            problems.push(format!(
                "{}: files {} import each other: {}",
                krate.name,
                comp.iter().cloned().collect::<Vec<_>>().join(", "),
                one_cycle(&g, &comp)
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "module import cycles (see the top of this test):\n{}",
        problems.join("\n")
    );
}

#[test]
fn finds_a_cycle_and_reads_use_trees() {
    let code = strip_comments_and_literals("use crate::{a::{B, c::D}, e};\n// crate::zz::Q\nlet s = \"crate::yy::R\"; super::f::g(); kid::x();");
    let kids = BTreeSet::from(["kid".to_string()]);
    let p: Vec<String> = paths(&code, &kids)
        .into_iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        p,
        [
            "crate::a::B",
            "crate::a::c::D",
            "crate::e",
            "super::f::g",
            "kid::x"
        ]
    );
    let g: BTreeMap<String, BTreeSet<String>> = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]
        .iter()
        .map(|(x, y)| (x.to_string(), BTreeSet::from([y.to_string()])))
        .collect();
    let comps = cycles(&g);
    assert_eq!(comps.len(), 1);
    assert_eq!(one_cycle(&g, &comps[0]), "a -> b -> c -> a");
    let tests = strip_test_items("use crate::x;\n#[cfg(test)]\nmod tests { use crate::y; }\n");
    assert!(tests.contains("crate::x") && !tests.contains("crate::y"));
}
