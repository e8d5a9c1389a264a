"""Generator of the tokenizer training corpus in this directory (seeded, original text).

Run: python models/assets/corpus/generate_corpus.py  (rewrites the .txt files).
"""
import os
import random
import textwrap

r = random.Random(20261202)
out = os.path.dirname(os.path.abspath(__file__))
os.makedirs(out, exist_ok=True)

people = ["Ada", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kavya", "Liam", "Maya", "Noah", "Olu", "Priya", "Quinn", "Rosa", "Sam", "Tara", "the engineer", "the captain", "my neighbour", "the teacher", "a young farmer", "the old librarian", "our team", "the committee"]
places = ["the harbour", "a quiet village", "the city library", "the mountain pass", "the train station", "a crowded market", "the research lab", "the river bank", "an empty office", "the school garden", "the data centre", "a small bakery", "the north coast", "the museum", "the workshop"]
verbs = ["walked to", "looked at", "wrote about", "dreamed of", "built", "repaired", "painted", "measured", "explained", "discovered", "visited", "remembered", "described", "questioned", "organised"]
things = ["the broken clock", "a letter from home", "the new bridge", "an unusual map", "the morning light", "a cup of tea", "the last chapter", "the quarterly report", "a wooden boat", "the garden fence", "a strange noise", "the weather forecast", "a set of keys", "the budget", "a paper plane", "the network cable", "the server logs", "a loaf of bread"]
adverbs = ["slowly", "carefully", "suddenly", "happily", "quietly", "without a word", "at dawn", "after lunch", "late at night", "with great care", "in a hurry", "once again"]
connect = ["Then", "Later", "Meanwhile", "After that", "Still", "However", "Because of this", "In the end", "Before long", "At first", "Soon"]
feel = ["tired but hopeful", "curious", "a little nervous", "proud", "confused", "calm", "delighted", "worried about the cost", "sure it would work", "ready for anything"]
adjs = ["bright", "cold", "narrow", "ancient", "modern", "noisy", "peaceful", "tall", "tiny", "heavy", "green", "golden", "careful", "simple", "elegant"]

def sentence():
    k = r.random()
    p, v, t, a = r.choice(people), r.choice(verbs), r.choice(things), r.choice(adverbs)
    if k < 0.3:
        s = f"{p} {v} {t} {a}."
    elif k < 0.5:
        s = f"{r.choice(connect)}, {p} {v} {t} near {r.choice(places)}."
    elif k < 0.65:
        s = f"In {r.choice(places)}, the air was {r.choice(adjs)} and {r.choice(adjs)}."
    elif k < 0.8:
        s = f"{p} felt {r.choice(feel)} when {r.choice(people)} {v} {t}."
    elif k < 0.9:
        s = f"It took {r.randint(2, 59)} minutes and {r.randint(1, 12)} tries, but {p} finally {v} {t}."
    else:
        s = f"\"Why is {t} so {r.choice(adjs)}?\" asked {p}."
    return s[0].upper() + s[1:]

prose = []
for _ in range(900):
    para = " ".join(sentence() for _ in range(r.randint(3, 8)))
    prose.append(textwrap.fill(para, 88) if r.random() < 0.5 else para)
open(f"{out}/prose.txt", "w").write("\n\n".join(prose) + "\n")

topics = [("a paged KV cache", "it stores keys and values in fixed-size blocks, so memory is allocated in small pieces and freed as soon as a request ends"),
          ("continuous batching", "new requests join the running batch at every step instead of waiting for the whole batch to finish"),
          ("a safetensors file", "it is a small JSON header followed by raw tensor bytes, which can be memory-mapped without running any code"),
          ("rotary position embeddings", "they rotate pairs of query and key features by an angle that grows with the token position"),
          ("RMS normalisation", "each vector is divided by the square root of the mean of its squares, then scaled by a learned weight"),
          ("grouped-query attention", "several query heads share one key and value head, which makes the cache smaller"),
          ("greedy decoding", "the model always picks the token with the highest score"),
          ("top-p sampling", "it keeps the smallest set of tokens whose probabilities add up to p and samples among them"),
          ("a tokenizer", "it turns text into integer ids and back again"),
          ("a unit test", "it checks one behaviour of the code and fails loudly when that behaviour changes"),
          ("bread dough", "flour, water, salt and yeast are mixed, kneaded and left to rise for a few hours"),
          ("a rainbow", "sunlight is bent and reflected inside raindrops, which splits it into colours"),
          ("a compost heap", "kitchen scraps and leaves are broken down by microbes into dark, rich soil"),
          ("the water cycle", "water evaporates, forms clouds, falls as rain and flows back to the sea"),
          ("a budget", "it lists expected income and spending so that you can plan ahead"),
          ("a binary search", "it halves a sorted range at every step until it finds the value or runs out of range")]
asks = ["What is {t}?", "Can you explain {t} simply?", "How does {t} work?", "I keep hearing about {t}. What is it?", "Tell me about {t} in one paragraph."]
dlg = []
for _ in range(700):
    t, a = r.choice(topics)
    q = r.choice(asks).format(t=t)
    ans = f"In short, {a}. " + " ".join(sentence() for _ in range(r.randint(0, 2)))
    if r.random() < 0.5:
        dlg.append(f"User: {q}\nAssistant: {ans.strip()}\nUser: Thanks! {r.choice(['That helps.', 'Got it.', 'One more question.', 'Interesting.'])}\nAssistant: You're welcome. Let me know if you have other questions.")
    else:
        dlg.append(f"<|start_of_role|>user<|end_of_role|>{q}<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>{ans.strip()}<|end_of_text|>")
open(f"{out}/dialogue.txt", "w").write("\n\n".join(dlg) + "\n")

names = ["total", "count", "items", "values", "blocks", "tokens", "scores", "rows", "batch", "queue", "result", "buffer", "offset", "limit", "window", "weights"]
funcs = ["compute", "load", "parse", "merge", "split", "normalise", "collect", "schedule", "allocate", "release", "render", "validate", "encode", "decode"]
code = []
for _ in range(650):
    f, a, b = r.choice(funcs), r.choice(names), r.choice(names)
    k = r.random()
    if k < 0.35:
        code.append(f'''def {f}_{a}({a}: list[int], {b}: int = {r.randint(1, 64)}) -> list[int]:
    """{f.capitalize()} the {a} in groups of {b}."""
    out = []
    for i in range(0, len({a}), {b}):
        chunk = {a}[i : i + {b}]
        if not chunk:
            continue
        out.append(sum(chunk) // len(chunk))
    return out
''')
    elif k < 0.6:
        code.append(f'''class {f.capitalize()}{a.capitalize()}:
    def __init__(self, {b}, limit={r.randint(8, 4096)}):
        self.{b} = {b}
        self.limit = limit

    def __len__(self):
        return len(self.{b})

    def {f}(self, x):
        if x > self.limit:
            raise ValueError(f"{{x}} exceeds the limit {{self.limit}}")
        return self.{b}[x]
''')
    elif k < 0.75:
        code.append(f'''import numpy as np

{a} = np.zeros(({r.randint(1, 32)}, {r.choice([64, 128, 256, 512])}), dtype=np.float32)
{b} = {a}.sum(axis=-1, keepdims=True)
print({a}.shape, {b}.dtype, np.abs({a} - {b}).max())
''')
    elif k < 0.87:
        code.append(f'''function {f}{a.capitalize()}({a}, {b}) {{
  const out = [];
  for (let i = 0; i < {a}.length; i++) {{
    if ({a}[i] !== {b}) {{
      out.push({a}[i] * {r.randint(2, 9)});
    }}
  }}
  return out;
}}
''')
    else:
        code.append(f'''$ curl -s http://localhost:8000/v1/completions \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "granite-tiny", "prompt": "{sentence()}", "max_tokens": {r.randint(1, 256)}, "temperature": {r.choice([0, 0.2, 0.7, 1.0])}}}'
{{"id": "cmpl-{r.randrange(16**8):08x}", "object": "text_completion", "choices": [{{"index": 0, "text": "...", "finish_reason": "length"}}]}}
''')
open(f"{out}/code.txt", "w").write("\n".join(code))

multi = ["Grüße aus München! Das Wetter ist schön.", "¿Dónde está la estación de tren?", "Ça va très bien, merci.", "日本語のテキストも少し含めます。", "今天天气很好，我们去公园散步吧。", "한국어 문장도 있습니다.", "Привет, как дела?", "مرحبا بالعالم", "Emoji: 😀 🚀 🎉 👍 ❤️ 🌍 ☕ 🐍", "Math: α + β = γ, ∑ x² ≤ ∞, π ≈ 3.14159", "Prices: €12.50, £9.99, ¥1200, $3.75"]
lines = []
for i in range(400):
    lines.append(f"{i + 1}. {r.choice(multi)} {sentence()}")
for _ in range(300):
    lines.append(f"{2026 - r.randint(0, 60)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}  order #{r.randint(1000, 99999)}  qty {r.randint(1, 40)}  total {r.randint(1, 999)}.{r.randint(0, 99):02d}")
open(f"{out}/misc.txt", "w").write("\n".join(lines) + "\n")

# A wider vocabulary: word-bank sentences, invented names and code identifiers.
NOUNS = """time year people way day man woman child world life hand part eye place work week case point
government company number group problem fact house area money story month lot right study book job word
business issue side kind head service friend father mother power hour game line end member law car city
community name president team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl guy moment air teacher force
education foot boy age policy process music market sense nation plan college interest death experience
effect class control care field development role effort rate heart drug show leader light voice wife police
mind price report decision son view relationship town road arm difference value building action model season
society tax director position player record paper space ground form event official matter center couple site
project activity star table need court oil situation cost industry figure street image phone data picture
practice piece land product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population scene answer garden
kitchen river mountain island forest ocean valley bridge tower castle village harbor desert engine machine
circuit signal memory storage network protocol server client request response kernel thread stream buffer
socket packet router switch cable battery sensor camera screen keyboard printer library framework function
variable parameter argument compiler interpreter debugger profiler benchmark database query index schema
cluster container pipeline deployment release version branch commit merge conflict review feature bug patch
algorithm matrix vector tensor gradient optimizer layer neuron weight bias activation attention embedding
token sequence vocabulary sentence paragraph chapter letter message email calendar meeting schedule deadline
budget invoice receipt payment account balance customer supplier contract warehouse shipment package delivery
weather cloud rain snow wind storm thunder lightning sunrise sunset planet galaxy comet orbit telescope rocket
apple banana orange grape lemon cherry peach tomato potato carrot onion garlic pepper cheese butter bread
coffee sugar honey salt flour rice noodle soup salad sandwich dinner breakfast lunch recipe oven spoon plate
""".split()
VERBS = """accept achieve add admire admit advise afford agree alert allow amuse announce annoy answer apologise
appear applaud appreciate approve argue arrange arrive ask attach attack attempt attend attract avoid bake balance
ban bang bathe battle beam behave belong bleach bless blind blink blush boast boil bolt bomb book bore borrow
bounce bow box brake branch breathe bruise brush bubble bump burn bury buzz calculate call camp care carry carve
cause challenge change charge chase cheat check cheer chew choke chop claim clap clean clear clip close coach
coil collect colour comb command communicate compare compete complain complete concentrate concern confess
confuse connect consider consist contain continue copy correct cough count cover crack crash crawl cross crush
cry cure curl curve cycle dam damage dance dare decay deceive decide decorate delay delight deliver depend
describe desert deserve destroy detect develop disagree disappear discover dislike divide double doubt drag
drain dream dress drip drop drown dry dust earn educate embarrass employ empty encourage end enjoy enter
entertain escape examine excite excuse exercise exist expand expect explain explode extend face fade fail
fancy fasten fax fear fence fetch file fill film fire fit fix flap flash float flood flow flower fold follow
fool force form found frame frighten fry gather gaze glow glue grab grate grease greet grin grip groan guarantee
guard guess guide hammer hand handle hang happen harm hate haunt head heal heap heat help hook hop hope hover
hug hum hunt hurry identify ignore imagine impress improve include increase influence inform inject injure
instruct intend interest interfere interrupt introduce invent invite irritate itch jail jam jog join joke judge
juggle jump kick kill kiss kneel knit knock knot label land last laugh launch learn level license lick lie
lighten like list listen live load lock long look love manage march mark marry match mate matter measure melt
memorise mend milk mine miss mix moan moor mourn move muddle mug multiply murder nail name need nest nod note
notice number obey object observe obtain occur offend offer open order overflow owe own pack paddle paint park
part pass paste pat pause peck pedal peel peep perform permit phone pick pinch pine place plan plant play please
plug point poke polish pop possess post pour practise pray preach precede prefer prepare present preserve press
pretend prevent prick print produce program promise protect provide pull pump punch puncture punish push
""".split()
ADJS = """able bad best better big black certain clear different early easy economic federal free full good
great hard high human important international large late little local long low major military national new old
only other political possible public real recent right small social special strong sure true white whole young
ancient angry anxious bitter brave bright broad busy calm careful cheap clever cloudy clumsy colourful curious
damp dangerous dark dear deep delicate dirty dry dull eager efficient elegant empty enormous exact expensive
faint fair famous fancy fast fierce flat fluffy foolish fragile fresh friendly funny gentle gigantic glamorous
graceful greasy grumpy handsome happy healthy heavy helpful hollow hot huge hungry icy immense innocent itchy
jolly juicy kind lazy light lively lonely loud lucky magnificent massive mighty modern narrow nervous nice noisy
obedient odd orange polite powerful precious proud purple quick quiet rapid rare raspy rich ripe rotten rough
round salty scary shallow sharp shiny short shy silly skinny slow smooth soft solid sour sparkling spicy steep
sticky stormy strange sweet tall tame tender thick thin thirsty tiny tough ugly uneven useful vast warm weak
wet wide wild wise witty wooden worried yellow zealous
""".split()
SYL = ["ka", "lo", "mi", "ren", "tas", "vel", "dor", "an", "is", "qu", "bra", "shi", "to", "nu", "zel", "fa", "gor", "hi", "yan", "pe", "wit", "ul", "sor", "den", "mar", "el", "ox", "ri", "cha", "ven"]

def word(kind):
    return r.choice(kind)

def bank_sentence():
    k = r.random()
    if k < 0.25:
        s = f"the {word(ADJS)} {word(NOUNS)} will {word(VERBS)} the {word(NOUNS)}."
    elif k < 0.5:
        s = f"we {word(VERBS)}ed every {word(NOUNS)} because the {word(NOUNS)} was {word(ADJS)}."
    elif k < 0.7:
        s = f"if you {word(VERBS)} a {word(ADJS)} {word(NOUNS)}, it becomes {word(ADJS)} and {word(ADJS)}."
    elif k < 0.85:
        s = f"{word(NOUNS)}s and {word(NOUNS)}s are {word(ADJS)}er than {word(ADJS)} {word(NOUNS)}s."
    else:
        name = "".join(r.choice(SYL) for _ in range(r.randint(2, 4))).capitalize()
        s = f"{name} said the {word(NOUNS)} in {name}ville is {word(ADJS)}."
    return s[0].upper() + s[1:]

bank = []
for _ in range(3500):
    bank.append(" ".join(bank_sentence() for _ in range(r.randint(2, 6))))
idents = []
for _ in range(2500):
    a, b, c = word(VERBS), word(NOUNS), word(NOUNS)
    k = r.random()
    if k < 0.4:
        idents.append(f"def {a}_{b}({c}, {b}_count={r.randint(0, 999)}):\n    return {c}.{a}({b}_count)\n")
    elif k < 0.7:
        idents.append(f"const {a}{b.capitalize()} = await {c}Service.get{b.capitalize()}({r.randint(0, 99)});\n")
    else:
        idents.append(f"{b}_{c}_{a} = {b}.{a}({c}, {word(ADJS)}=True)  # {word(ADJS)} {c}\n")
open(f"{out}/wordbank.txt", "w").write("\n\n".join(bank) + "\n\n" + "\n".join(idents))
