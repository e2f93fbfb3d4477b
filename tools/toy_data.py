#!/usr/bin/python3
"""Deterministic training and evaluation data for the kvevict toy models (issue 5).

Token ids: 0..255 are bytes, 256 = BOS, 257 = EOS, 258 = <AC> (the AnLLM anchor), as in
src/lib/model/random_model.hpp and the "bytes" tokenizer of config.json.

Prose comes from two Debian packages (neither is needed to build or test kvevict):
  bible-kjv       the King James Bible, dumped with `bible -f -m 8000 gen1:1-rev22:21`
                  (one "Ge1:1 text" line per verse; the references are dropped). One chapter is
                  one document, verses are joined by "\n".
  fortunes        fortune-mod's English cookie files (/usr/share/games/fortunes/*), one fortune
                  is one document (blank lines collapsed, tabs -> spaces).
Held-out split (never trained on): the KJV books HELDOUT_KJV_BOOKS (John rather than a synoptic
gospel, whose parallels in Matthew and Luke are nearly verbatim) and the fortune files
HELDOUT_FORTUNE_FILES; a train sentence (>= 30 bytes) that also occurs in the held-out split is
dropped from the train split. Every evaluation set draws its prose from the held-out split only.

Sentences: a sentence ends after [.?!] (plus closing quotes / brackets) followed by whitespace,
and at the end of a document; the whitespace after a sentence belongs to the next one. In anchor
mode (toy-anchor, AnLLM-AC) the token <AC> follows every sentence end, e.g. "light.<AC> And".
The corpora are stored as lists of such sentence units, so documents are built with exact token
counts whether anchors are inserted or not.

Every generator returns a Doc: tokens (ids), w (per-token loss weight of predicting that token
from its prefix; BOS has weight 0) and ans (0, or the id > 0 of the answer the token belongs to,
for accuracy), plus the task name and metadata. Answers carry `answer_weight`.

Tasks (all built so that next-token loss teaches copying from far back):
  passkey   a 5-digit key stated once at a depth in filler prose, asked for at the end
            (Mohtashami & Jaggi's format); training docs may ask it 1-3 times.
  named     several "The key of NAME is VALUE." sentences scattered in filler, queries for some.
  assoc     multi-query associative recall: "Remember these pairs: kiv=37, mor=12, ..." then
            filler, then "Recall: mor=12, kiv=37, ..." (values are the answers).
  grocery   SirLLM's grocery task as free recall: a shopping list in the first user turn,
            dialogue turns of filler, then the list is asked for. Turns end with TURN_SEP
            ("\n\n", which never occurs inside filler): `kvevict stream --turn-separator '\n\n'`.
  repeat    a prose span, filler, then the same span again (dense induction targets; training
            only).
  prose     plain prose rows (BOS + consecutive sentences).

Filler inside task documents never contains digits (keys and values are the only digits).
Everything is drawn from numpy Generators seeded by the caller: the same seed gives the same
bytes on every machine.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BOS, EOS, AC = 256, 257, 258
VOCAB = 259
TURN_SEP = "\n\n"

HELDOUT_KJV_BOOKS = ("Ruth", "Eccl", "John", "Jas")
HELDOUT_FORTUNE_FILES = ("literature", "science", "wisdom")
SKIP_FORTUNE_FILES = ("ascii-art", "translate-me")
FORTUNE_DIR = Path("/usr/share/games/fortunes")

CACHE_DIR = Path(os.environ.get("KVEVICT_TOY_CACHE", Path.home() / ".cache" / "kvevict-toy"))

SENTENCE_END = re.compile(rb"[.?!][\"')\]]*(?=\s|$)")

NAMES = (
    "Alice", "Bruno", "Carla", "Dmitri", "Edith", "Felix", "Greta", "Hugo", "Irene", "Jonas",
    "Karla", "Lukas", "Mara", "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sven", "Tilda", "Umar",
    "Vera", "Walter", "Xenia", "Yusuf", "Zora", "Anton", "Berta", "Conrad", "Dora", "Emil",
    "Frieda", "Gustav", "Hanna", "Igor", "Julia", "Kurt", "Lena", "Moritz", "Nora", "Oskar",
    "Paula", "Rudolf", "Selma", "Theo", "Ulla", "Viktor", "Wanda", "Yvonne", "Zeno",
)
GROCERIES = (
    "apples", "bananas", "bread", "butter", "carrots", "cheese", "chicken", "coffee", "cookies",
    "corn", "cream", "cucumbers", "eggs", "fish", "flour", "garlic", "grapes", "ham", "honey",
    "jam", "juice", "lemons", "lettuce", "milk", "mushrooms", "noodles", "oats", "oil", "olives",
    "onions", "oranges", "pasta", "peaches", "pears", "peas", "pepper", "pickles", "potatoes",
    "rice", "salt", "sausages", "soap", "soup", "spinach", "sugar", "tea", "tomatoes", "tuna",
    "vinegar", "walnuts", "water", "yogurt", "beans",
)
CONSONANTS = "bcdfghjklmnprstvwz"
VOWELS = "aeiou"


# ---------------------------------------------------------------------------------------------
# Corpora
# ---------------------------------------------------------------------------------------------

def _kjv_text() -> str:
    """The whole KJV as printed by `bible` (cached; the cache is checked by its digest)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / "kjv.txt"
    if not path.exists():
        try:
            out = subprocess.run(["bible", "-f", "-m", "8000", "gen1:1-rev22:21"], check=True,
                                 capture_output=True).stdout
        except FileNotFoundError as error:
            raise SystemExit("toy_data: the `bible` program is missing: apt-get install "
                             "bible-kjv") from error
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(out)
        tmp.rename(path)
    return path.read_bytes().decode("ascii")


_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def kjv_documents() -> list[tuple[str, str]]:
    """[(book, chapter text)] in canonical order; verses joined by newlines."""
    chapters: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int]] = []
    for line in _kjv_text().splitlines():
        match = _VERSE.match(line)
        if not match:
            continue
        key = (match.group(1), int(match.group(2)))
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append(match.group(4).strip())
    return [(book, "\n".join(chapters[(book, chapter)])) for book, chapter in order]


def fortune_documents() -> list[tuple[str, str]]:
    """[(file, fortune text)] for the English fortune files present (fortunes, fortunes-min)."""
    docs: list[tuple[str, str]] = []
    if not FORTUNE_DIR.is_dir():
        return docs
    for path in sorted(FORTUNE_DIR.iterdir()):
        if path.suffix or not path.is_file() or path.name in SKIP_FORTUNE_FILES:
            continue
        raw = path.read_bytes().decode("utf-8", errors="replace")
        for entry in raw.split("\n%\n"):
            entry = entry.replace("\t", " ")
            entry = "".join(ch if (" " <= ch <= "~") or ch == "\n" else " " for ch in entry)
            lines = [re.sub(r" {2,}", " ", line).strip() for line in entry.split("\n")]
            text = "\n".join(line for line in lines if line)
            text = text.strip("%\n ")
            if len(text) >= 20:
                docs.append((path.name, text))
    return docs


def split_units(text: bytes) -> tuple[list[bytes], list[bool]]:
    """Sentence units of one document: the text split after each sentence end; the whitespace
    after an end starts the next unit. The document's end is a sentence end."""
    units: list[bytes] = []
    ends: list[bool] = []
    start = 0
    for match in SENTENCE_END.finditer(text):
        if match.end() > start:
            units.append(text[start:match.end()])
            ends.append(True)
            start = match.end()
    if start < len(text):
        units.append(text[start:])
        ends.append(True)
    return units, ends


@dataclass
class Corpus:
    """Sentence units of one split, documents joined by "\\n" (each document's first unit starts
    with "\\n" except the very first)."""
    name: str
    units: list[bytes] = field(default_factory=list)
    ends: list[bool] = field(default_factory=list)
    clean: np.ndarray | None = None  # indices of units usable as task filler (no digits)

    def add_document(self, text: str) -> None:
        data = text.encode("ascii", errors="replace")
        units, ends = split_units(data)
        if not units:
            return
        if self.units:
            units[0] = b"\n" + units[0]
        self.units.extend(units)
        self.ends.extend(ends)

    def finish(self) -> "Corpus":
        digit = re.compile(rb"[0-9]")
        self.clean = np.array([i for i, u in enumerate(self.units)
                               if not digit.search(u) and b"\n\n" not in u and len(u) < 400],
                              dtype=np.int64)
        return self

    def total_bytes(self) -> int:
        return sum(len(u) for u in self.units)


_CORPORA: dict[str, Corpus] = {}


def corpus(split: str) -> Corpus:
    """'train' or 'heldout' (cached per process)."""
    if split not in ("train", "heldout"):
        raise ValueError(split)
    if split not in _CORPORA:
        train, heldout = Corpus("train"), Corpus("heldout")
        for book, text in kjv_documents():
            (heldout if book in HELDOUT_KJV_BOOKS else train).add_document(text)
        for name, text in fortune_documents():
            (heldout if name in HELDOUT_FORTUNE_FILES else train).add_document(text)
        # Sentences that occur in both splits (repeated verses, a quotation in two fortune
        # files) leave the train split.
        seen = {u.strip() for u in heldout.units if len(u.strip()) >= 30}
        keep = [k for k, u in enumerate(train.units) if u.strip() not in seen]
        train.units = [train.units[k] for k in keep]
        train.ends = [train.ends[k] for k in keep]
        _CORPORA["train"] = train.finish()
        _CORPORA["heldout"] = heldout.finish()
    return _CORPORA[split]


def corpus_digest() -> str:
    """SHA-256 over both splits' bytes (recorded in the training log / config)."""
    digest = hashlib.sha256()
    for split in ("train", "heldout"):
        for unit in corpus(split).units:
            digest.update(unit)
        digest.update(b"\0")
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------------

@dataclass
class Doc:
    tokens: list[int]
    w: list[float]
    ans: list[int]
    task: str = ""
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)


class Builder:
    """Appends text pieces (each with a weight and an answer id) and, in anchor mode, <AC> after
    every piece marked as a sentence end."""

    def __init__(self, anchors: bool, anchor_weight: float = 1.0, bos: bool = True):
        self.anchors = anchors
        self.anchor_weight = anchor_weight
        self.tokens: list[int] = [BOS] if bos else []
        self.w: list[float] = [0.0] if bos else []
        self.ans: list[int] = [0] if bos else []
        self.next_answer = 1

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, text: str | bytes, weight: float = 1.0, ans: int = 0,
            end: bool = False) -> "Builder":
        data = text.encode("ascii") if isinstance(text, str) else text
        self.tokens.extend(data)
        self.w.extend([weight] * len(data))
        self.ans.extend([ans] * len(data))
        if end and self.anchors:
            self.tokens.append(AC)
            self.w.append(self.anchor_weight)
            self.ans.append(0)
        return self

    def answer(self, text: str, weight: float) -> int:
        """Appends `text` as a new answer; returns its id."""
        ident = self.next_answer
        self.next_answer += 1
        self.add(text, weight, ans=ident)
        return ident

    def extend(self, other: "Builder") -> "Builder":
        """Appends another builder's tokens (answer ids renumbered)."""
        offset = self.next_answer - 1
        self.tokens.extend(other.tokens)
        self.w.extend(other.w)
        self.ans.extend(a + offset if a else 0 for a in other.ans)
        self.next_answer += other.next_answer - 1
        return self

    def cost(self, text: str, end: bool) -> int:
        return len(text) + (1 if end and self.anchors else 0)

    def doc(self, task: str, **meta) -> Doc:
        return Doc(self.tokens, self.w, self.ans, task, meta)


def _fragment(anchors: bool, anchor_weight: float) -> Builder:
    return Builder(anchors, anchor_weight, bos=False)


def add_filler(b: Builder, n: int, rng: np.random.Generator, src: Corpus,
               weight: float = 1.0) -> int:
    """Appends about `n` tokens (never more) of consecutive clean prose: whole sentence units,
    then the start of the next unit cut at a word boundary (no sentence end). Returns the tokens
    added."""
    if n <= 0:
        return 0
    start = len(b)
    clean = src.clean
    i = int(rng.integers(0, len(clean)))
    while True:
        unit = src.units[clean[i % len(clean)]].replace(b"\n\n", b"\n")
        end = src.ends[clean[i % len(clean)]]
        room = n - (len(b) - start)
        cost = len(unit) + (1 if end and b.anchors else 0)
        if cost <= room:
            b.add(unit, weight, end=end)
            i += 1
            continue
        if room > 0:
            piece = unit[:room]
            cut = piece.rfind(b" ")
            if cut > 0 and len(piece) < len(unit):
                piece = piece[:cut]
            b.add(piece, weight)
        break
    return len(b) - start


def add_prose(b: Builder, n: int, rng: np.random.Generator, src: Corpus, start: int | None = None,
              weight: float = 1.0) -> int:
    """Appends exactly `n` tokens of consecutive prose (any units; the last may be cut anywhere).
    Returns the index of the unit after the last one used."""
    i = int(rng.integers(0, len(src.units))) if start is None else start
    target = len(b) + n
    while len(b) < target:
        unit = src.units[i % len(src.units)]
        end = src.ends[i % len(src.units)]
        room = target - len(b)
        if len(unit) + (1 if end and b.anchors else 0) <= room:
            b.add(unit, weight, end=end)
        else:
            b.add(unit[:room], weight)
        i += 1
    return i


def _split(total: int, parts: int, rng: np.random.Generator) -> list[int]:
    """`total` split into `parts` random non-negative integers."""
    if parts == 1:
        return [total]
    cuts = np.sort(rng.integers(0, total + 1, size=parts - 1))
    edges = np.concatenate([[0], cuts, [total]])
    return [int(x) for x in np.diff(edges)]


def _tail(b: Builder, T: int | None, rng: np.random.Generator, src: Corpus) -> None:
    """Fills a training row to exactly T tokens with prose after a newline."""
    if T is None or len(b) >= T:
        return
    if T - len(b) > 1:
        b.add("\n")
    add_prose(b, T - len(b), rng, src)


def passkey_doc(rng: np.random.Generator, length: int, src: Corpus, anchors: bool = False,
                depth: float | None = None, key: str | None = None, queries: int = 1,
                answer_weight: float = 5.0, anchor_weight: float = 1.0,
                fill_row: bool = False, intro: bool = True, echo: bool = True) -> Doc:
    """Passkey retrieval. The key sentence starts after `depth` of the filler (uniform when None);
    the first query follows the rest of the filler. `length` is the document's token count
    (filler adjusts; exact for training rows with fill_row, at most `length` otherwise).
    intro: the opening "There is a pass key hidden ..." sentences; echo: "Remember it. KEY is the
    pass key." after the key (both on in evaluation; training drops them at random)."""
    if key is None:
        key = str(int(rng.integers(10000, 100000)))
    mk = lambda: _fragment(anchors, anchor_weight)  # noqa: E731
    opening = mk()
    if intro:
        opening.add("There is a pass key hidden in this text.", end=True)
        opening.add(" Find it and remember it.", end=True)
    statement = mk()
    statement.add(" The pass key is ")
    statement.add(key).add(".", end=True)
    if echo:
        statement.add(" Remember it.", end=True)
        statement.add(" " + key + " is the pass key.", end=True)
    qs = []
    for _ in range(queries):
        q = mk()
        q.add(" What is the pass key?", end=True)
        q.add(" The pass key is ")
        q.answer(key, answer_weight)
        q.add(".", end=True)
        qs.append(q)
    fixed = 1 + len(opening) + len(statement) + sum(len(q) for q in qs)
    filler = max(0, length - fixed)
    if depth is None:
        depth = float(rng.random())
    b = Builder(anchors, anchor_weight)
    b.extend(opening)
    main = filler if queries == 1 else int(filler * rng.uniform(0.6, 0.95))
    before = int(round(depth * main))
    add_filler(b, before, rng, src)
    key_position = len(b)
    b.extend(statement)
    add_filler(b, main - before, rng, src)
    rest = _split(filler - main, max(1, queries - 1), rng) if queries > 1 else []
    for k, q in enumerate(qs):
        if k > 0:
            add_filler(b, rest[k - 1], rng, src)
        b.extend(q)
    _tail(b, length if fill_row else None, rng, src)
    return b.doc("passkey", key=key, depth=depth, key_position=key_position)


def _value(rng: np.random.Generator, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def named_doc(rng: np.random.Generator, length: int, src: Corpus, anchors: bool = False,
              names: int | None = None, queries: int | None = None, digits: int = 4,
              answer_weight: float = 5.0, anchor_weight: float = 1.0,
              fill_row: bool = False) -> Doc:
    """Named keys: `names` statements "The key of NAME is VALUE." at random places in the
    filler, then `queries` questions for distinct names in random order."""
    if names is None:
        names = int(rng.integers(2, 7))
    if queries is None:
        queries = int(rng.integers(1, names + 1))
    chosen = [NAMES[i] for i in rng.choice(len(NAMES), size=names, replace=False)]
    values = [_value(rng, digits) for _ in chosen]
    mk = lambda: _fragment(anchors, anchor_weight)  # noqa: E731
    statements = []
    for name, value in zip(chosen, values):
        s = mk()
        s.add(f" The key of {name} is {value}.", end=True)
        statements.append(s)
    asked = rng.choice(names, size=queries, replace=False)
    qs = []
    for j in asked:
        q = mk()
        q.add(f" What is the key of {chosen[j]}?", end=True)
        q.add(f" The key of {chosen[j]} is ")
        q.answer(values[j], answer_weight)
        q.add(".", end=True)
        qs.append(q)
    fixed = 1 + sum(len(s) for s in statements) + sum(len(q) for q in qs)
    gaps = _split(max(0, length - fixed), names + 1, rng)
    b = Builder(anchors, anchor_weight)
    for s, gap in zip(statements, gaps):
        add_filler(b, gap, rng, src)
        b.extend(s)
    add_filler(b, gaps[-1], rng, src)
    for q in qs:
        b.extend(q)
    _tail(b, length if fill_row else None, rng, src)
    return b.doc("named", names=chosen, values=values, asked=[int(j) for j in asked])


def _word(rng: np.random.Generator) -> str:
    return (CONSONANTS[rng.integers(len(CONSONANTS))] + VOWELS[rng.integers(len(VOWELS))] +
            CONSONANTS[rng.integers(len(CONSONANTS))])


def assoc_doc(rng: np.random.Generator, length: int, src: Corpus, anchors: bool = False,
              pairs: int | None = None, queries: int | None = None,
              answer_weight: float = 5.0, anchor_weight: float = 1.0,
              fill_row: bool = False) -> Doc:
    """Multi-query associative recall: keys are random consonant-vowel-consonant words, values
    two-digit numbers; the queries repeat `queries` keys in random order, values are answers."""
    if pairs is None:
        pairs = int(rng.integers(4, 13))
    if queries is None:
        queries = pairs
    keys: list[str] = []
    while len(keys) < pairs:
        word = _word(rng)
        if word not in keys:
            keys.append(word)
    values = [_value(rng, 2) for _ in keys]
    mk = lambda: _fragment(anchors, anchor_weight)  # noqa: E731
    table = mk()
    table.add(" Remember these pairs: " + ", ".join(f"{k}={v}" for k, v in zip(keys, values)) + ".",
              end=True)
    asked = rng.choice(pairs, size=queries, replace=False)
    q = mk()
    q.add(" Recall: ")
    for n, j in enumerate(asked):
        q.add(("" if n == 0 else ", ") + keys[j] + "=")
        q.answer(values[j], answer_weight)
    q.add(".", end=True)
    fixed = 1 + len(table) + len(q)
    before, between = _split(max(0, length - fixed), 2, rng)
    b = Builder(anchors, anchor_weight)
    add_filler(b, before, rng, src)
    b.extend(table)
    add_filler(b, between, rng, src)
    b.extend(q)
    _tail(b, length if fill_row else None, rng, src)
    return b.doc("assoc", keys=keys, values=values, asked=[int(j) for j in asked])


def grocery_doc(rng: np.random.Generator, length: int, src: Corpus, anchors: bool = False,
                items: int | None = None, turns: int | None = None,
                answer_weight: float = 5.0, anchor_weight: float = 1.0,
                fill_row: bool = False) -> Doc:
    """SirLLM grocery task, free recall: the list in the first user turn, `turns` dialogue turns
    of filler (alternating User / Assistant, each ended by TURN_SEP), then the question and the
    list as the answer (each item one answer; separators weighted too)."""
    if items is None:
        items = int(rng.integers(3, 7))
    chosen = [GROCERIES[i] for i in rng.choice(len(GROCERIES), size=items, replace=False)]
    mk = lambda: _fragment(anchors, anchor_weight)  # noqa: E731
    first = mk()
    first.add("User: Remember my shopping list: " + ", ".join(chosen) + ".", end=True)
    first.add(TURN_SEP)
    last = mk()
    last.add("User: What was on my shopping list?", end=True)
    last.add(TURN_SEP + "Assistant: ")
    for n, item in enumerate(chosen):
        if n:
            last.add(", ", answer_weight)
        last.answer(item, answer_weight)
    last.add(".", answer_weight, end=True)
    fixed = 1 + len(first) + len(last)
    budget = max(0, length - fixed)
    if turns is None:
        most = max(1, min(20, budget // 60))
        turns = int(rng.integers(max(1, most // 2), most + 1))
    # Filler turns alternate Assistant / User and end with an assistant turn, so that the recall
    # question (a user turn) follows one: an odd number of turns.
    turns += 1 - turns % 2
    speakers = ("Assistant: ", "User: ")
    per_turn_fixed = [len(speakers[t % 2]) + len(TURN_SEP) for t in range(turns)]
    gaps = _split(max(0, budget - sum(per_turn_fixed)), turns, rng)
    b = Builder(anchors, anchor_weight)
    b.extend(first)
    for t in range(turns):
        b.add(speakers[t % 2])
        add_filler(b, gaps[t], rng, src)
        b.add(TURN_SEP)
    b.extend(last)
    _tail(b, length if fill_row else None, rng, src)
    return b.doc("grocery", items=chosen, turns=turns)


def repeat_doc(rng: np.random.Generator, length: int, src: Corpus, anchors: bool = False,
               copy_weight: float = 2.0, anchor_weight: float = 1.0,
               fill_row: bool = False) -> Doc:
    """A span of 1-3 clean sentences, filler, then the span again (copy targets)."""
    clean = src.clean
    i = int(rng.integers(0, len(clean)))
    span_units = [(src.units[clean[(i + k) % len(clean)]].replace(b"\n", b" ").strip(),
                   src.ends[clean[(i + k) % len(clean)]])
                  for k in range(int(rng.integers(1, 4)))]
    mk = lambda: _fragment(anchors, anchor_weight)  # noqa: E731
    first = mk()
    first.add(" Read this:")
    second = mk()
    second.add(" Again:")
    for unit, end in span_units:
        first.add(b" " + unit, end=end)
        second.add(b" ", copy_weight)
        ident = second.next_answer
        second.next_answer += 1
        second.add(unit, copy_weight, ans=ident, end=end)
    fixed = 1 + len(first) + len(second)
    before, between = _split(max(0, length - fixed), 2, rng)
    b = Builder(anchors, anchor_weight)
    add_filler(b, before, rng, src)
    b.extend(first)
    add_filler(b, between, rng, src)
    b.extend(second)
    _tail(b, length if fill_row else None, rng, src)
    return b.doc("repeat")


def prose_doc(rng: np.random.Generator, length: int, src: Corpus, anchors: bool = False,
              anchor_weight: float = 1.0, start: int | None = None, **_) -> Doc:
    """BOS + exactly length - 1 tokens of consecutive prose."""
    b = Builder(anchors, anchor_weight)
    add_prose(b, length - 1, rng, src, start=start)
    return b.doc("prose")


GENERATORS = {
    "passkey": passkey_doc,
    "named": named_doc,
    "assoc": assoc_doc,
    "grocery": grocery_doc,
    "repeat": repeat_doc,
    "prose": prose_doc,
}


def training_doc(task: str, rng: np.random.Generator, length: int, anchors: bool,
                 answer_weight: float, max_queries: int = 3) -> Doc:
    """One training row of exactly `length` tokens for `task`, with the training-time
    randomisation (several passkey queries, varied key lengths, task sizes scaled to length)."""
    src = corpus("train")
    common = dict(anchors=anchors, fill_row=True)
    if task == "passkey":
        digits = int(rng.choice([5, 5, 5, 3, 4, 6, 7, 8]))
        key = _value(rng, digits)
        queries = int(rng.integers(1, min(max_queries, max(1, length // 128)) + 1))
        short = length < 256
        intro = not short and bool(rng.random() < 0.5)
        echo = not short and bool(rng.random() < 0.5)
        doc = passkey_doc(rng, length, src, key=key, queries=queries, intro=intro, echo=echo,
                          answer_weight=answer_weight, **common)
    elif task == "named":
        most = max(2, min(8, length // 64))
        names = int(rng.integers(2, most + 1))
        queries = int(rng.integers(1, min(names, max(1, length // 128)) + 1))
        doc = named_doc(rng, length, src, names=names, queries=queries,
                        answer_weight=answer_weight, **common)
    elif task == "assoc":
        most = max(4, min(16, length // 24))
        doc = assoc_doc(rng, length, src, pairs=int(rng.integers(3, most + 1)),
                        answer_weight=answer_weight, **common)
    elif task == "grocery":
        most = 2 if length < 192 else min(6, length // 40)
        doc = grocery_doc(rng, length, src, items=int(rng.integers(2, most + 1)),
                          answer_weight=answer_weight, **common)
    elif task == "repeat":
        doc = repeat_doc(rng, length, src, **common)
    elif task == "prose":
        doc = prose_doc(rng, length, src, anchors=anchors)
    else:
        raise ValueError(f"unknown task {task!r}")
    if len(doc) > length:  # fixed parts longer than a short row: cut (answers may be lost)
        doc = Doc(doc.tokens[:length], doc.w[:length], doc.ans[:length], doc.task, doc.meta)
    return doc


# ---------------------------------------------------------------------------------------------
# Evaluation sets (held-out prose only)
# ---------------------------------------------------------------------------------------------

EVAL_DEPTHS = (0.1, 0.5, 0.9)


def eval_sets(length: int, anchors: bool, n: int = 64, seed: int = 20240905,
              lengths: tuple[int, ...] | None = None) -> dict[str, list[Doc]]:
    """Fixed evaluation documents over held-out prose. Keys:
      passkey@L@d   passkey, key at depth d of the filler, documents of L tokens (L in `lengths`,
                    default (length,)), one query at the end
      named@L, assoc@L, grocery@L   one document size each (4 names / all 4 asked; 8 pairs /
                    all asked; 5 items)
      prose@L       held-out prose rows (consecutive, from the start of the held-out split)
    The same seed gives the same documents; keys differ per document."""
    src = corpus("heldout")
    sets: dict[str, list[Doc]] = {}
    for L in (lengths or (length,)):
        for depth in EVAL_DEPTHS:
            rng = np.random.default_rng([seed, L, int(depth * 100), 1])
            sets[f"passkey@{L}@{depth}"] = [
                passkey_doc(rng, L, src, anchors=anchors, depth=depth) for _ in range(n)]
        rng = np.random.default_rng([seed, L, 2])
        sets[f"named@{L}"] = [named_doc(rng, L, src, anchors=anchors, names=4, queries=4)
                              for _ in range(n)]
        rng = np.random.default_rng([seed, L, 3])
        sets[f"assoc@{L}"] = [assoc_doc(rng, L, src, anchors=anchors, pairs=8, queries=8)
                              for _ in range(n)]
        rng = np.random.default_rng([seed, L, 4])
        sets[f"grocery@{L}"] = [grocery_doc(rng, L, src, anchors=anchors, items=5)
                                for _ in range(n)]
        rng = np.random.default_rng([seed, L, 5])
        docs, start = [], 0
        for _ in range(n):
            b = Builder(anchors)
            start = add_prose(b, L - 1, rng, src, start=start)
            docs.append(b.doc("prose"))
        sets[f"prose@{L}"] = docs
    return sets


def to_text(doc: Doc) -> str:
    """Readable rendering: <s> for BOS, <AC> for anchors, [..] around answer bytes."""
    out, inside = [], False
    for token, ans in zip(doc.tokens, doc.ans):
        if ans and not inside:
            out.append("[")
        if not ans and inside:
            out.append("]")
        inside = bool(ans)
        special = {BOS: "<s>", EOS: "</s>", AC: "<AC>"}
        out.append(special.get(token, chr(token) if token < 256 else "?"))
    if inside:
        out.append("]")
    return "".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stats", action="store_true", help="corpus sizes and digest")
    parser.add_argument("--show", choices=sorted(GENERATORS), help="print an example document")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--anchors", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--export-heldout-kjv", metavar="PATH",
                        help="write the held-out KJV books (public domain) as plain text: one "
                        "chapter per paragraph, verses on their own lines; kvevict's eval harness "
                        "builds its documents from this file (data/kjv-heldout.txt)")
    args = parser.parse_args()
    if args.export_heldout_kjv:
        chapters = [text for book, text in kjv_documents() if book in HELDOUT_KJV_BOOKS]
        Path(args.export_heldout_kjv).write_text("\n\n".join(chapters) + "\n", encoding="ascii")
    if args.stats:
        for split in ("train", "heldout"):
            c = corpus(split)
            print(f"{split}: {len(c.units)} sentence units, {c.total_bytes()} bytes, "
                  f"{len(c.clean)} clean units")
        print("digest", corpus_digest())
    if args.show:
        rng = np.random.default_rng(args.seed)
        doc = training_doc(args.show, rng, args.length, args.anchors, 5.0)
        print(to_text(doc))
        print(f"-- {len(doc)} tokens, {sum(1 for a in doc.ans if a)} answer tokens, "
              f"{sum(1 for t in doc.tokens if t == AC)} anchors, meta {doc.meta}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
