"""Fixed test prompts (written for this project)."""

from __future__ import annotations

# For the distribution pair: lowercase letters, space, '.', ',' and newline only.
# They start with a space, where both tokenizers agree on word boundaries.
LOWERCASE = [
    " the keeper of the light walked down to the shore",
    " a small house stood by the river, and in it lived",
    " it was the last day of the long summer. the children",
    " she opened the old book and read the first line",
    " the market was busy in the morning, with people",
    " on the hill there is a tree that",
    " when the rain came, the farmers",
    " he said that the road to the city",
    " the boat moved slowly across the water",
    " they built a fire and sat around it, telling",
    " in the evening the wind",
    " the teacher wrote the words on the board",
    " there was once a king who had three",
    " the letter arrived on a cold morning in",
    " we walked for hours along the narrow path",
    " her brother liked to cook, and every sunday",
    " the old man at the corner of the street",
    " after the storm the garden was",
    " the train left the station at noon",
    " his first job was at a small shop",
    " the cat slept near the warm stove",
    " at the end of the day, the workers",
    " the island was green and quiet, and",
    " nobody knew where the sound came from",
    " the road turned north, past the",
    " the baker opened the door and",
    " many years later, the village",
    " the doctor listened to the",
    " the lake was still, and the",
    " by the window sat a girl who",
    " the song they sang was about",
    " every morning the fisherman",
]

# For the tokenizer fixtures: where re-tokenization breaks.
HARD = [
    "Hello world",
    "The café serves crème brûlée",
    "Grüße aus München und Zürich",
    "東京は日本の首都です。",
    "한국어 문장입니다",
    "Emoji: 😀🎉👩‍👩‍👧 and 🇫🇷 flags",
    "def f(x):\n\treturn x * 2\n",
    "int main() {\r\n\tprintf(\"hi\\n\");\r\n}",
    "   lots    of     spaces   ",
    "\n\n\nnewlines first",
    "tabs\t\tand\ttabs",
    "SELECT * FROM t WHERE a = 'b';",
    "<html><body>Ωμέγα</body></html>",
    "naïve façade, coöperate",
    "Mixed: abc 123 — “quotes” ‘single’",
    "x",
]
