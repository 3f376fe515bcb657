#!/usr/bin/env python3
"""make lint: check relative Markdown links and #anchors in README.md, SECURITY.md and docs/**/*.md.
GitHub anchor rules: lowercase, drop punctuation except '-' and '_' (and spaces), spaces -> '-',
duplicates get -1, -2 ...; explicit <a id="..."> / <a name="..."> anchors count too."""
import os, re, sys, glob
root = sys.argv[1] if len(sys.argv) > 1 else "."
os.chdir(root)
files = ["README.md", "SECURITY.md"] + sorted(glob.glob("docs/**/*.md", recursive=True))

def strip_code(text):
    # remove fenced code blocks, keep line count
    out, fence = [], None
    for line in text.split("\n"):
        m = re.match(r"^\s*(```|~~~)", line)
        if m:
            fence = None if fence else m.group(1)
            out.append("")
            continue
        out.append("" if fence else line)
    return "\n".join(out)

def slug(h):
    h = re.sub(r"<[^>]+>", "", h)            # html tags
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)  # links -> text
    h = h.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h, flags=re.UNICODE)  # drop punctuation (keeps _ and -)
    return h.replace(" ", "-")

anchor_cache = {}
def anchors(path):
    if path in anchor_cache: return anchor_cache[path]
    text = strip_code(open(path, encoding="utf-8").read())
    seen, result = {}, set()
    for line in text.split("\n"):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            result.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
        for a in re.findall(r'<a\s+(?:id|name)="([^"]+)"', line):
            result.add(a)
    anchor_cache[path] = result
    return result

link_re = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
bad, total = [], 0
for f in files:
    text = strip_code(open(f, encoding="utf-8").read())
    # drop inline code spans
    text = re.sub(r"`[^`\n]*`", "", text)
    for ln, line in enumerate(text.split("\n"), 1):
        for target in link_re.findall(line):
            if re.match(r"^[a-z]+:", target):   # http:, mailto: ...
                continue
            total += 1
            path, _, frag = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
            if not os.path.exists(dest):
                bad.append(f"{f}:{ln}: missing file {target}")
                continue
            if os.path.isdir(dest):
                if frag: bad.append(f"{f}:{ln}: anchor on a directory {target}")
                continue
            if frag and dest.endswith(".md") and frag not in anchors(dest):
                bad.append(f"{f}:{ln}: missing anchor {target}")
print(f"checked {total} relative links in {len(files)} files")
for b in bad: print("BROKEN", b)
print("OK" if not bad else f"{len(bad)} broken")
sys.exit(1 if bad else 0)
