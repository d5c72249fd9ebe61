"""Names and roles for the rules verifier: which tokens are names (known, code-like or
capitalised), whether a name matches across a typo, and the (source, target) roles that directed
connectors give the terms around them ("USD to EUR", "from Paris to Rome", "tea than coffee")."""

from __future__ import annotations

import re

from fulcrum.cache import verifier_words as w

NUMBER = re.compile(r"^(\d[\d,]*(?:\.\d+)?)(?::(\d\d))?([a-z%°]*)$")
FUZZY_MIN_LEN = 5  # names this long match across one typo
_SENTENCE_END = frozenset({".", "?", "!"})
_ROLE_WINDOW = 4  # a connector binds the terms at most this many tokens away
_TITLE_CASE_SHARE = 0.9  # "How To Reset My Password": case says nothing about names
_TITLE_CASE_MIN_TOKENS = 4
_CONNECTORS = w.FORWARD_CONNECTORS | w.BACKWARD_CONNECTORS | w.UNIT_ONLY_CONNECTORS


def name_flags(text: str, raw: list[str], words: tuple[str, ...]) -> tuple[bool, ...]:
    """Which tokens are (parts of) names: known ones, code-like ones, capitalised ones."""
    capitals = [t for t in raw if t[:1].isupper()]
    use_case = len(raw) < _TITLE_CASE_MIN_TOKENS or len(capitals) < _TITLE_CASE_SHARE * len(raw)
    starts = _sentence_starts(text, raw)
    flags = []
    for i, (token, word) in enumerate(zip(raw, words, strict=True)):
        if word in w.STOPWORDS or word in w.UNITS or NUMBER.match(word):
            flags.append(False)
        elif word in w.GAZETTEER or _looks_like_code(token):
            flags.append(True)
        else:
            flags.append(use_case and token[:1].isupper() and (i not in starts or token.isupper()))
    return tuple(flags)


def _sentence_starts(text: str, raw: list[str]) -> set[int]:
    """Indexes of tokens that open a sentence (capitalised by grammar, not as names)."""
    starts, cursor = {0}, 0
    for i, token in enumerate(raw):
        at = max(cursor, text.find(token, cursor))
        if text[cursor:at].strip()[-1:] in _SENTENCE_END:
            starts.add(i)
        cursor = at + len(token)
    return starts


def _looks_like_code(token: str) -> bool:
    """iPhone, GitHub, gpt4, a100, os.path, snake_case: names whatever their position."""
    inner_capital = any(c.isupper() for c in token[1:]) and not token.isupper()
    has_digit = token[:1].isalpha() and any(c.isdigit() for c in token)
    return (
        inner_capital or has_digit or "_" in token or re.search(r"[a-z]\.[a-z]", token) is not None
    )


def entity_matched(entity: str, words: frozenset[str], joined: frozenset[str]) -> bool:
    if entity in words or entity in joined:
        return True
    if len(entity) < FUZZY_MIN_LEN:
        return False
    return any(abs(len(x) - len(entity)) <= 1 and within_one_edit(entity, x) for x in words)


def within_one_edit(x: str, y: str) -> bool:
    if len(x) > len(y):
        x, y = y, x
    i = 0
    while i < len(x) and x[i] == y[i]:
        i += 1
    if len(x) == len(y):
        return x[i + 1 :] == y[i + 1 :] or (
            x[i : i + 2] == y[i : i + 2][::-1] and x[i + 2 :] == y[i + 2 :]
        )
    return x[i:] == y[i + 1 :]


def role_terms(words: tuple[str, ...], names: tuple[bool, ...]) -> tuple[str | None, ...]:
    """Each token's key term: a run of name tokens is one term ("new york"), a name is kept as
    written (not stemmed: https is not http), other words by `_term`."""
    terms: list[str | None] = []
    i = 0
    while i < len(words):
        if not names[i]:
            terms.append(_term(words[i]))
            i += 1
            continue
        j = i
        while j < len(words) and names[j]:
            j += 1
        terms += [" ".join(words[i:j])] * (j - i)
        i = j
    return tuple(terms)


def _term(word: str) -> str | None:
    """A word as a key term for roles: its unit, or its stem; None for a function word."""
    if word in w.UNITS and (len(word) >= w.STANDALONE_MIN_LEN or word in w.STANDALONE_SHORT_UNITS):
        return w.UNITS[word]
    if word in w.STOPWORDS or word in w.NEGATORS or word in _CONNECTORS:
        return None
    return stem(word)


def read_roles(words: tuple[str, ...], terms: tuple[str | None, ...]) -> frozenset[tuple[str, str]]:
    roles: set[tuple[str, str]] = set()
    for i, word in enumerate(words):
        forward = word in w.FORWARD_CONNECTORS or word in w.UNIT_ONLY_CONNECTORS
        if not forward and word not in w.BACKWARD_CONNECTORS:
            continue
        left = _nearest_term(terms, range(i - 1, max(-1, i - 1 - _ROLE_WINDOW), -1), word)
        right = _nearest_term(terms, range(i + 1, min(len(terms), i + 1 + _ROLE_WINDOW)), word)
        if left is None or right is None or left == right:
            continue
        if word in w.UNIT_ONLY_CONNECTORS and not {left, right} <= set(w.UNITS.values()):
            continue
        roles.add((left, right) if forward else (right, left))
    return frozenset(roles)


def _nearest_term(terms: tuple[str | None, ...], span: range, connector: str) -> str | None:
    for j in span:
        term = terms[j]
        if term is None:
            continue
        if connector == "than" and (term in w.COMPARATIVE_WORDS or term.endswith("er")):
            continue  # "whale bigger than shark": the roles are whale and shark
        return term
    return None


def stem(word: str) -> str:
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word
