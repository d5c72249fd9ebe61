"""The rules verifier: whether a cached text may answer a new one although the embedder scores
them alike. It looks for the differences that change an answer — numbers, units, negations,
antonyms, scope words, named entities and the order of the key terms — each a named reason.
Pure Python and regexes: tens of microseconds a pair, nothing to download."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from fulcrum.cache import verifier_names as names
from fulcrum.cache import verifier_words as w
from fulcrum.cache.protocols import Verdict

# Tokens: C++/C#, currency and degree signs, arrows, and words or numbers with inner . , : '
_TOKEN = re.compile(
    r"[A-Za-z]\+\+|[A-Za-z]#|°[CcFf]|->|[$€£¥₹%→]|"
    r"[A-Za-z0-9]+(?:[.,:'’_/][A-Za-z0-9]+)*"
)
_ORDINAL_SUFFIXES = frozenset({"st", "nd", "rd", "th", "s", "x"})
_DETERMINERS = frozenset({"which", "this", "that", "the", "each", "any", "every", "no", "one"})
_CACHE_TEXTS = 4096  # readings kept: a hot cached text is read once, not on every lookup


@dataclass(frozen=True, slots=True)
class Reading:
    """What the rules read from one text."""

    words: tuple[str, ...]  # lower case, apostrophes dropped
    numbers: tuple[float, ...]  # sorted: a multiset
    number_terms: frozenset[tuple[float, str]]  # (value, the term it counts)
    units: frozenset[str]
    negations: int
    antonym_sides: frozenset[tuple[int, int]]  # (pair index, side)
    scope: dict[str, frozenset[str]]
    entities: frozenset[str]
    roles: frozenset[tuple[str, str]]  # (source, target) around a directed connector


class RulesVerifier:
    """protocols.Verifier by rules; `differences` lists every reason, `__call__` the first."""

    def __call__(self, query: str, candidate: str) -> Verdict:
        found = self.differences(query, candidate)
        return Verdict(ok=False, reason=found[0]) if found else Verdict(ok=True)

    def differences(self, query: str, candidate: str) -> tuple[str, ...]:
        """The reasons, in a fixed order, why `candidate`'s answer may not answer `query`."""
        a, b = read(query), read(candidate)
        checks = (
            ("number", _numbers_differ),
            ("unit", _units_differ),
            ("negation", _negation_differs),
            ("antonym", _antonyms_differ),
            ("scope", _scope_differs),
            ("entity", _entities_differ),
            ("order", _roles_swapped),
        )
        return tuple(name for name, differs in checks if differs(a, b))


@lru_cache(maxsize=_CACHE_TEXTS)
def read(text: str) -> Reading:
    """The reading of one text (cached: the same cached entry is checked again and again)."""
    text = text.replace("’", "'")
    raw = _TOKEN.findall(text)
    words = tuple(_normal(t) for t in raw)
    numbers, number_terms, number_units = _read_numbers(words)
    phrase = f" {' '.join(words)} "
    flags = names.name_flags(text, raw, words)
    return Reading(
        words=words,
        numbers=tuple(sorted(numbers)),
        number_terms=frozenset(number_terms),
        units=frozenset(number_units | _read_units(words)),
        negations=_count_negations(words),
        antonym_sides=_antonym_sides(words, phrase),
        scope=_read_scope(words, phrase),
        entities=frozenset(word for word, name in zip(words, flags, strict=True) if name),
        roles=names.read_roles(words, names.role_terms(words, flags)),
    )


def _normal(token: str) -> str:
    """Lower case without apostrophes or a possessive: "Today's" -> today, "can't" -> cant."""
    lower = token.lower()
    if lower.endswith("'s"):
        lower = lower[:-2]
    return lower.replace("'", "")


# ---- numbers and units ----


def _read_numbers(words: tuple[str, ...]) -> tuple[list[float], list[tuple[float, str]], set[str]]:
    values: list[float] = []
    terms: list[tuple[float, str]] = []
    units: set[str] = set()
    i = 0
    while i < len(words):
        value, unit, i_next = _number_at(words, i)
        if value is None:
            i += 1
            continue
        values.append(value)
        if unit is not None:
            units.add(unit)
        term = _term_after(words, i_next)
        if term is not None:
            terms.append((value, term))
        i = i_next
    return values, terms, units


def _number_at(words: tuple[str, ...], i: int) -> tuple[float | None, str | None, int]:
    """The number starting at word i (digits or words), its unit suffix, and the next index."""
    match = names.NUMBER.match(words[i])
    if match is not None:
        value = float(match.group(1).replace(",", ""))
        if match.group(2):
            value += int(match.group(2)) / 60
        suffix = match.group(3)
        if suffix == "k":
            return value * 1000, None, i + 1
        unit = w.UNITS.get(suffix) if suffix and suffix not in _ORDINAL_SUFFIXES else None
        return value, unit, i + 1
    return _number_words_at(words, i)


def _number_words_at(words: tuple[str, ...], i: int) -> tuple[float | None, str | None, int]:
    word = words[i]
    if word == "one" and (i == 0 or words[i - 1] in _DETERMINERS or i + 1 == len(words)):
        return None, None, i + 1  # "which one", "this one": a pronoun, not a count
    if word not in w.NUMBER_WORDS and word not in w.MULTIPLIERS:
        return None, None, i + 1
    total, current, j = 0.0, 0.0, i
    while j < len(words) and (words[j] in w.NUMBER_WORDS or words[j] in w.MULTIPLIERS):
        if words[j] in w.MULTIPLIERS:
            current = (current or 1) * w.MULTIPLIERS[words[j]]
            total, current = total + current, 0.0
        else:
            current += w.NUMBER_WORDS[words[j]]
        j += 1
    return total + current, None, j


def _term_after(words: tuple[str, ...], i: int) -> str | None:
    """The thing a number counts: its unit, or the next content word (`2 adults` -> adult)."""
    for word in words[i : i + 2]:
        if word in w.UNITS:
            return w.UNITS[word]
        if word not in w.STOPWORDS and not names.NUMBER.match(word):
            return names.stem(word)
    return None


def _read_units(words: tuple[str, ...]) -> set[str]:
    units: set[str] = set()
    for i, word in enumerate(words):
        unit = w.UNITS.get(word)
        if unit is None:
            continue
        after_number = i > 0 and (
            names.NUMBER.match(words[i - 1]) or words[i - 1] in w.NUMBER_WORDS
        )
        if after_number or word in w.STANDALONE_SHORT_UNITS or len(word) >= w.STANDALONE_MIN_LEN:
            units.add(unit)
    return units


def _numbers_differ(a: Reading, b: Reading) -> bool:
    if a.numbers != b.numbers:
        return True
    # Same numbers counting different things: "2 adults, 1 child" vs "1 adult, 2 children".
    counted_a = {term: value for value, term in a.number_terms}
    counted_b = {term: value for value, term in b.number_terms}
    return any(counted_b.get(term, value) != value for term, value in counted_a.items())


def _units_differ(a: Reading, b: Reading) -> bool:
    return bool(a.units and b.units and a.units != b.units)


# ---- negations, antonyms, scope ----


def _count_negations(words: tuple[str, ...]) -> int:
    return sum(1 for word in words if word in w.NEGATORS)


def _prefixed_negations(words: tuple[str, ...], other: frozenset[str]) -> int:
    """Words like `unsafe` whose stem (`safe`) the other text holds: each a negation."""
    count = 0
    for word in words:
        for prefix in w.NEGATING_PREFIXES:
            stem = word[len(prefix) :].lstrip("-")
            if word.startswith(prefix) and len(stem) >= w.MIN_STEM_LEN and stem in other:
                count += 1
                break
    return count


def _negation_differs(a: Reading, b: Reading) -> bool:
    words_a, words_b = frozenset(a.words), frozenset(b.words)
    total_a = a.negations + _prefixed_negations(a.words, words_b)
    total_b = b.negations + _prefixed_negations(b.words, words_a)
    return total_a % 2 != total_b % 2  # parity: "not unsafe" reads as "safe"


@lru_cache(maxsize=1)
def _antonym_index() -> tuple[dict[str, set[tuple[int, int]]], list[tuple[str, int, int]]]:
    """Inflected single words -> their (pair, side)s; multi-word phrases listed apart."""
    words: dict[str, set[tuple[int, int]]] = {}
    phrases: list[tuple[str, int, int]] = []
    for pair, sides in enumerate(w.ANTONYMS):
        for side, bases in enumerate(sides):
            for base in bases:
                if " " in base:
                    phrases.append((f" {base} ", pair, side))
                else:
                    for form in _inflections(base):
                        words.setdefault(form, set()).add((pair, side))
    return words, phrases


def _inflections(base: str) -> set[str]:
    forms = {base, base + "s", base + "es", base + "ed", base + "d", base + "ing"}
    if base.endswith("e"):
        forms |= {base[:-1] + "ing", base[:-1] + "ed"}
    if base.endswith("y"):
        forms |= {base[:-1] + "ies", base[:-1] + "ied"}
    if len(base) <= 4 and base[-1] not in "aeiouwy":  # stop -> stopped, win -> winning
        forms |= {base + base[-1] + "ed", base + base[-1] + "ing"}
    return forms


def _antonym_sides(words: tuple[str, ...], phrase: str) -> frozenset[tuple[int, int]]:
    single, phrases = _antonym_index()
    sides = {found for word in words for found in single.get(word, ())}
    sides |= {(pair, side) for text, pair, side in phrases if text in phrase}
    return frozenset(sides)


def _antonyms_differ(a: Reading, b: Reading) -> bool:
    pairs = {pair for pair, _ in a.antonym_sides} & {pair for pair, _ in b.antonym_sides}
    for pair in pairs:
        sides_a = {side for p, side in a.antonym_sides if p == pair}
        sides_b = {side for p, side in b.antonym_sides if p == pair}
        if not sides_a & sides_b:
            return True
    return False


def _read_scope(words: tuple[str, ...], phrase: str) -> dict[str, frozenset[str]]:
    found: dict[str, set[str]] = {}
    for key, (group, value) in w.SCOPE.items():
        if (f" {key} " in phrase) if " " in key else (key in words):
            found.setdefault(group, set()).add(value)
    for word in words:  # "tomorow" is tomorrow: a typo must not read as a missing scope word
        if word not in w.SCOPE and len(word) >= names.FUZZY_MIN_LEN:
            for group, value in _scope_near(word):
                found.setdefault(group, set()).add(value)
    return {group: frozenset(values) for group, values in found.items()}


@lru_cache(maxsize=_CACHE_TEXTS)
def _scope_near(word: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        meaning
        for key, meaning in w.SCOPE.items()
        if len(key) > names.FUZZY_MIN_LEN
        and abs(len(key) - len(word)) <= 1
        and names.within_one_edit(word, key)
    )


def _scope_differs(a: Reading, b: Reading) -> bool:
    for group in a.scope.keys() | b.scope.keys():
        values_a, values_b = a.scope.get(group, frozenset()), b.scope.get(group, frozenset())
        if values_a and values_b:
            if values_a != values_b:
                return True
            continue
        one_sided = values_a or values_b
        if group in w.STRICT_SCOPE and any(
            (group, v) not in w.SCOPE_TWO_SIDED_ONLY for v in one_sided
        ):
            return True
    return False


# ---- names and roles (verifier_names.py reads them) ----


def _entities_differ(a: Reading, b: Reading) -> bool:
    for mine, other in ((a, b), (b, a)):
        words = frozenset(other.words)
        joined = frozenset(x + y for x, y in zip(other.words, other.words[1:], strict=False))
        if any(not names.entity_matched(e, words, joined) for e in mine.entities):
            return True
    return False


def _roles_swapped(a: Reading, b: Reading) -> bool:
    return any((target, source) in b.roles for source, target in a.roles)
