"""The lab's text gives its reasons and sources itself. A user of the lab has no access to the project's tracker, so a
reason given as the word "issue" and a number (or "issues" and numbers, "#" or not) tells them nothing: the package,
configs, docs, committed results, workflow, benchmarks and tests say the reason, or cite a public source. A public
anchor names its repository ("pytorch/pytorch#76918", "trl#878") and stays; so does a tracker reference preceded by the
project's name (PUBLIC_PROJECTS, kept small) or an owner/repo."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the folders and files whose words a user reads
SCANNED = ("lab", "configs", "docs", "results", "workflow", "benchmarks", "tests", "notebooks", ".ci",
           "README.md", "Makefile", "Snakefile", "pyproject.toml")
#: folders a run or a tool writes (gitignored), not the lab's words
WRITTEN = {"runs", "logs", "tensorboard", "__pycache__", ".snakemake", ".ipynb_checkpoints", ".pytest_cache"}
BINARY = {".png", ".pt", ".pth", ".npz", ".npy", ".gz", ".whl", ".pyc", ".bin", ".safetensors", ".jpg", ".jpeg"}

WORD = "issue"  # built here so that this file's own examples are not references
#: the word, optionally plural, then a number: "<word> 50", "<word>s 40, 51", "<word> #58", "<Word> 67.2", "<word>-58"
NUMBERED = re.compile(rf"\b{WORD}s?[\s#-]*\d", re.IGNORECASE)
#: a public tracker's reference names its project right before the word: an owner/repo, or one of these
PUBLIC_PROJECTS = ("pytorch", "torch", "torchao", "trl", "verl", "transformers", "peft", "accelerate", "lightning",
                   "deepspeed", "transformerengine", "apex", "timm", "snakemake")
PUBLIC = re.compile(r"(?:[\w.-]+/[\w.-]+|\b(?:" + "|".join(PUBLIC_PROJECTS) + r"))(?:'s|')?\s*$", re.IGNORECASE)


def project_references(text: str) -> list[str]:
    """Each numbered tracker reference in `text` that names no public project before it, with its line."""
    found = []
    for m in NUMBERED.finditer(text):
        if PUBLIC.search(text[max(0, m.start() - 60):m.start()]):
            continue
        line_start = text.rfind("\n", 0, m.start()) + 1
        line_end = text.find("\n", m.end())
        found.append(text[line_start:line_end if line_end >= 0 else len(text)].strip()[:160])
    return found


def scanned_files(root: Path):
    for name in SCANNED:
        top = root / name
        paths = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for path in paths:
            rel = path.relative_to(root)
            if path.is_file() and path.suffix.lower() not in BINARY and not WRITTEN.intersection(rel.parts):
                yield rel, path


def test_the_detector_flags_project_numbers_and_keeps_public_anchors():
    w = WORD
    for text in (f"a reason ({w} 50)", f"({w} 67.2)", f"{w.title()} 57's case", f"{w}s 40, 51", f"{w} #58",
                 f"the {w}-58 study", f"configs/rl.yaml: {w} 50, in progress"):
        assert project_references(text), text
    for text in ("pytorch/pytorch#76918", "trl#878", f"pytorch {w} 160016", f"NVIDIA/TransformerEngine {w} 1169",
                 f"transformers' {w} 39972", f"DeepSpeed {w}s 4017", f"the verdict is '{w}s', 3 runs",
                 f"verdict,{w}s,raise_scale,0.22"):
        assert not project_references(text), text


def test_no_project_issue_number_in_the_labs_text():
    found = []
    for rel, path in scanned_files(REPO):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{rel}: {line}" for line in project_references(text)]
    assert not found, ("say the reason itself or cite the public source (a paper, a repository's own tracker):\n"
                       + "\n".join(found))
