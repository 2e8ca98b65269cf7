"""Word lists for the RULER-style tasks (keys of NIAH needles, the common-words-extraction vocabulary).

RULER draws keys and words from the `wonderwords` package, which is not a dependency here; these
short hand-written lists of everyday English words play the same role. Keys are ``adjective-noun``
pairs (81 x 122 = 9,882 distinct keys, enough for the distractor needles of a 128k prompt), and the
common-words vocabulary is every word below plus pronounceable pseudo-words when a long prompt needs
more distinct words than English lists provide.
"""

from __future__ import annotations

import itertools
import random
from functools import lru_cache

ADJECTIVES = """
able ancient angry bitter black blue bold brave bright broad brown busy calm careful cheap clean clear
clever cold cool crisp curious damp dark deep dry dusty eager early easy empty faint fair famous fancy
fast fierce flat fresh gentle giant glad golden grand gray green happy hard heavy hidden hollow honest
huge humble jolly keen kind large late lazy light little lively long loud lucky mild modern narrow
neat noble odd old pale plain polite proud quick quiet rapid rare
""".split()

NOUNS = """
anchor apple arrow badge basket beacon bell blanket boat bottle bridge brush bucket button cabin
camera candle canvas carpet castle cattle chair chimney circle cloud coat coin comet compass copper
cottage crown crystal cup curtain desk diamond dragon drum eagle engine falcon feather fence field
flag flame flower forest fountain garden gate glove hammer harbor hat helmet hill horse island jacket
jewel kettle kingdom ladder lamp lantern leaf lemon letter lion lizard magnet map marble meadow mirror
monkey mountain needle nest ocean orange otter owl palace panther parrot pebble pencil pepper piano
pillow pirate planet pocket pond puzzle quilt rabbit radio raven ribbon river robot rocket saddle
sailor shadow shell shield silver spoon statue stone storm sword table temple thread tiger tower
""".split()

VERBS = """
accept admire answer arrive bake borrow breathe build carry catch change climb collect cook cover
dance deliver depend discover divide dream drink drive earn enjoy explain fetch finish float follow
gather greet guard hurry imagine invent jump juggle kneel knit laugh listen march measure melt mend
notice offer open paint plant polish promise pull push repair rescue return roll sail search shout
""".split()

# Keys must be unique strings, so the lists must hold no duplicates.
assert len(set(ADJECTIVES)) == len(ADJECTIVES) and len(set(NOUNS)) == len(NOUNS)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@lru_cache(maxsize=1)
def _pseudo_words() -> tuple[str, ...]:
    """Pronounceable 3-syllable pseudo-words (cv-cv-cv, 343k of them), in a fixed shuffled order."""
    syll = [c + v for c in _CONSONANTS for v in _VOWELS]
    real = set(ADJECTIVES) | set(NOUNS) | set(VERBS)
    words = ["".join(p) for p in itertools.product(syll, repeat=3)]
    words = [w for w in words if w not in real]
    random.Random(1234).shuffle(words)
    return tuple(words)


def word_pool(n: int) -> list[str]:
    """At least ``n`` distinct words: the real English words first, pseudo-words only when needed."""
    real = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))
    if n <= len(real):
        return real
    extra = _pseudo_words()
    if n > len(real) + len(extra):
        raise ValueError(f"cannot provide {n} distinct words")
    return real + list(extra[: n - len(real)])
