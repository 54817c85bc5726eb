"""Training text for the tiny zoo models: corpus assembly, held-out split, BPE tokenizer, token streams.

Sources (every user has the first two; the third only where `../shared/data` exists):

| corpus  | source                                                                  |
|---------|-------------------------------------------------------------------------|
| code    | CPython standard library `.py` files (no test folders, idlelib, site-packages) |
| english | `pydoc_data.topics.topics` (the English help topics shipped with Python)  |
| prose   | shared `corpus/austen/*.txt`, `corpus/tinyshakespeare.txt`               |
| docs    | shared `corpus/python-docs/**/*.rst.txt`                                 |

Files are read in sorted order and cut into documents of at most `chunk_chars` characters at line
boundaries, so a single large file (a novel, tinyshakespeare) lands on both sides of the split. A
document is held out iff the SHA-256 of its name falls below `heldout_fraction`: the split depends on
names only (not on the seed, the caps or the other documents). Caps then keep a hash-ordered prefix of
each side, so a smaller cap gives a subset of a larger one.

Tokens: a byte-level BPE (`tokenizers`) with `<|endoftext|>` (id 0) and `<|pad|>` (id 1); every
document is encoded and followed by `<|endoftext|>`, and the documents of one corpus and side are
concatenated into one stream.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)  # ids 0 and 1
CORPORA = ("code", "english", "prose", "docs")
_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "site-packages", "__pycache__"})


@dataclass(frozen=True)
class Document:
    """One training document: a chunk of a source file, named `<source>/<relative path>#<chunk>`."""

    corpus: str
    name: str
    text: str


@dataclass
class CorpusSplit:
    """Documents per corpus name on each side of the split."""

    train: dict[str, list[Document]] = field(default_factory=dict)
    heldout: dict[str, list[Document]] = field(default_factory=dict)

    @property
    def corpora(self) -> list[str]:
        """Corpus names with at least one document, in `CORPORA` order."""
        return [c for c in CORPORA if self.train.get(c) or self.heldout.get(c)]

    def sizes(self) -> dict[str, dict[str, int]]:
        """{corpus: {train_docs, train_chars, heldout_docs, heldout_chars}}."""
        return {
            c: {
                "train_docs": len(self.train.get(c, [])),
                "train_chars": sum(len(d.text) for d in self.train.get(c, [])),
                "heldout_docs": len(self.heldout.get(c, [])),
                "heldout_chars": sum(len(d.text) for d in self.heldout.get(c, [])),
            }
            for c in self.corpora
        }


# ---------------------------------------------------------------------------------------------- sources
def chunk_text(text: str, max_chars: int) -> list[str]:
    """Cut `text` at line boundaries into pieces of at most `max_chars` (longer lines are split)."""
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    chunks: list[str] = []
    cur: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:  # a pathological line (minified data): hard split
            if cur:
                chunks.append("".join(cur))
                cur, size = [], 0
            chunks.append(line[:max_chars])
            line = line[max_chars:]
        if size + len(line) > max_chars and cur:
            chunks.append("".join(cur))
            cur, size = [], 0
        cur.append(line)
        size += len(line)
    if cur:
        chunks.append("".join(cur))
    return [c for c in chunks if c.strip()]


def _documents(corpus: str, prefix: str, files: Iterable[tuple[str, str]], max_chars: int) -> list[Document]:
    return [
        Document(corpus, f"{prefix}/{rel}#{i}", piece)
        for rel, text in files
        for i, piece in enumerate(chunk_text(text, max_chars))
    ]


def _read_sorted(root: Path, paths: Iterable[Path]) -> Iterator[tuple[str, str]]:
    """(posix path relative to root, utf-8 text) in sorted order; undecodable files are skipped."""
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        try:
            yield path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def stdlib_documents(max_chars: int, stdlib_dir: str | Path | None = None) -> list[Document]:
    """The "code" corpus: CPython standard library sources without tests, idlelib and site-packages."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & _STDLIB_SKIP_DIRS]
    return _documents("code", "stdlib", _read_sorted(root, files), max_chars)


def english_documents(max_chars: int) -> list[Document]:
    """The "english" corpus: the help topics in `pydoc_data.topics`, one file per topic."""
    from pydoc_data.topics import topics

    return _documents("english", "pydoc", ((k, topics[k]) for k in sorted(topics)), max_chars)


def shared_documents(shared_data: str | Path | None, max_chars: int) -> list[Document]:
    """The "prose" and "docs" corpora from `<shared_data>/corpus`; [] when that folder is absent."""
    if shared_data is None:
        return []
    root = Path(shared_data) / "corpus"
    if not root.is_dir():
        return []
    prose = sorted((root / "austen").glob("*.txt")) + sorted(root.glob("tinyshakespeare.txt"))
    docs = sorted((root / "python-docs").rglob("*.rst.txt"))
    return _documents("prose", "shared", _read_sorted(root, prose), max_chars) + _documents(
        "docs", "shared", _read_sorted(root, docs), max_chars
    )


# ---------------------------------------------------------------------------------------------- split
def name_hash(name: str, salt: str = "") -> float:
    """A uniform number in [0, 1) from the SHA-256 of `salt + name` (stable across runs and platforms)."""
    digest = hashlib.sha256(f"{salt}{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(name: str, heldout_fraction: float) -> bool:
    """Whether document `name` belongs to the held-out side (a function of the name only)."""
    return name_hash(name, "split:") < heldout_fraction


def cap_documents(docs: list[Document], max_chars: int | None) -> list[Document]:
    """A hash-ordered prefix of `docs` of at most `max_chars` characters (None or <0: no cap)."""
    ordered = sorted(docs, key=lambda d: name_hash(d.name, "order:"))
    if max_chars is None or max_chars < 0:
        return ordered
    kept, total = [], 0
    for doc in ordered:
        if total + len(doc.text) > max_chars:
            break
        kept.append(doc)
        total += len(doc.text)
    return kept


def split_corpus(
    docs: Iterable[Document],
    heldout_fraction: float,
    train_caps: dict[str, int] | None = None,
    heldout_caps: dict[str, int] | None = None,
) -> CorpusSplit:
    """Split documents by name hash, then cap each corpus and side (characters; missing key: no cap)."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    split = CorpusSplit()
    for doc in docs:
        side = split.heldout if is_heldout(doc.name, heldout_fraction) else split.train
        side.setdefault(doc.corpus, []).append(doc)
    for side, caps in ((split.train, train_caps or {}), (split.heldout, heldout_caps or {})):
        for corpus in list(side):
            side[corpus] = cap_documents(side[corpus], caps.get(corpus))
    return split


def assemble_corpus(
    shared_data: str | Path | None,
    heldout_fraction: float = 0.05,
    chunk_chars: int = 8192,
    train_caps: dict[str, int] | None = None,
    heldout_caps: dict[str, int] | None = None,
    stdlib_dir: str | Path | None = None,
) -> CorpusSplit:
    """All sources -> a capped train / held-out split (see the module docstring)."""
    docs = stdlib_documents(chunk_chars, stdlib_dir) + english_documents(chunk_chars)
    docs += shared_documents(shared_data, chunk_chars)
    return split_corpus(docs, heldout_fraction, train_caps, heldout_caps)


# ---------------------------------------------------------------------------------------------- tokens
def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE over `texts`; `<|endoftext|>` gets id 0, `<|pad|>` id 1. Lossless on any text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, f"{special} must have id {i}"
    return tok


def encode_stream(tok: Tokenizer, docs: list[Document], eos_id: int = 0) -> torch.Tensor:
    """Documents -> one int64 token stream [N] with `eos_id` after every document."""
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, length: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [W, length] from the start of `stream` [N] (the tail is dropped)."""
    count = stream.numel() // length
    if max_windows is not None:
        count = min(count, max_windows)
    return stream[: count * length].view(count, length)
