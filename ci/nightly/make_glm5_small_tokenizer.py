"""Build the tokenizer of the nightly's small GLM-5-shaped model into ci/nightly/models/glm5_small.

    python ci/nightly/make_glm5_small_tokenizer.py [OUT_DIR]

The runners hold no GLM-5 checkpoint and the nightly model has random weights, so what it needs from a
tokenizer is to be small, to load in transformers and vLLM like a real one, to encode any text (byte-level
BPE: no unknown token, exact round trip) and to render verl's chat prompts. The special tokens and the
chat layout follow GLM's ([gMASK]<sop>, then <|role|> turns), so the rollout stops and templates the way
it does for GLM-5. It is trained on a corpus generated here from a fixed seed: rerunning the script
rewrites byte-identical files (tests_npu/ci/test_ci_glm5_tokenizer.py checks), so the committed files are
reviewable as the output of this script and nothing else.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 4096  # ci/nightly/models/glm5_small/config.json's vocab_size; a multiple of 128 * TP
SPECIAL_TOKENS = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
EOS = "<|endoftext|>"
# A turn ends where the model starts another role's turn, as in GLM's generation config.
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
ROLES = ("system", "user", "assistant", "observation")
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in " + repr(list(ROLES)) + " -%}"
    "{{- raise_exception('chat role ' ~ message['role'] ~ ' is not one of " + ", ".join(ROLES) + "') -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
MODEL_MAX_LENGTH = 8192  # the model config's max_position_embeddings
SEED = 20261201


def _words(text: str) -> list[str]:
    return text.split()


NAMES = _words(
    "Ada Ben Carla Dev Elena Farid Greta Hugo Ines Jamal Kira Liam Maya Nico Olga Pablo Quinn Rosa Sami Tara Umar "
    "Vera Wes Xena Yusuf Zoe Amir Bea Chen Dana Emil Fatima Gus Hana Ivan June Kofi Lena Marco Nadia Omar Priya "
    "Rafael Sofia Tomas Uma Viktor Wanda Yara Zain Alice Bruno Clara David Erin Frank Grace Henry Isla Jack Kate"
)
ITEMS = _words(
    "apple apples banana bananas orange oranges pencil pencils marker markers book books notebook notebooks sticker "
    "stickers marble marbles cookie cookies cupcake cupcakes muffin muffins pie pies cake cakes candy candies "
    "ticket tickets shirt shirts sock socks shoe shoes hat hats toy toys car cars bike bikes ball balls card cards "
    "stamp stamps shell shells flower flowers tree trees seed seeds egg eggs chicken chickens cow cows sheep goat "
    "goats duck ducks fish bird birds dog dogs cat cats puppy puppies kitten kittens box boxes bag bags basket "
    "baskets jar jars bottle bottles cup cups plate plates bowl bowls sandwich sandwiches pizza pizzas slice slices "
    "candle candles balloon balloons present presents gift gifts coin coins bill bills brick bricks tile tiles "
    "board boards nail nails screw screws rope ropes bead beads bracelet bracelets necklace necklaces ring rings "
    "page pages chapter chapters song songs movie movies game games puzzle puzzles piece pieces question questions "
    "student students teacher teachers worker workers customer customers player players team teams class classes "
    "room rooms house houses floor floors window windows door doors garden gardens field fields farm farms "
    "truck trucks bus buses train trains boat boats plane planes seat seats row rows shelf shelves drawer drawers"
)
UNITS = _words(
    "dollar dollars cent cents hour hours minute minutes second seconds day days week weeks month months year years "
    "mile miles kilometer kilometers meter meters centimeter centimeters foot feet inch inches yard yards pound "
    "pounds ounce ounces kilogram kilograms gram grams liter liters gallon gallons cup cups dozen dozens percent"
)
VERBS = _words(
    "buys bought sells sold gives gave takes took makes made bakes baked eats ate drinks drank reads read writes "
    "wrote plants planted picks picked collects collected saves saved spends spent earns earned pays paid finds "
    "found loses lost keeps kept shares shared splits split packs packed fills filled empties emptied adds added "
    "removes removed counts counted walks walked runs ran drives drove rides rode swims swam climbs climbed "
    "paints painted builds built fixes fixed cuts cut sews sewed knits knitted orders ordered rents rented "
    "borrows borrowed lends lent donates donated trades traded wins won scores scored practices practiced "
    "charges charged costs cost weighs weighed measures measured fits fitted holds held carries carried"
)
WORDS = _words(
    "the a an and or but if then so because after before while during each every per all some many much more "
    "less fewer most least half twice three times double triple quarter third fifth tenth of to in on at by for "
    "with from into over under between among than as is are was were be been being has have had do does did will "
    "would can could should must may might not no yes only also just still already again left remaining rest "
    "total altogether together sum difference product quotient average ratio rate price cost profit discount tax "
    "tip change amount number numbers value values how what which who whom whose when where why many much long "
    "far fast old tall heavy wide deep high big small large new first second third last next same other another "
    "how many does did he she they we you it his her their our your its him them us me my mine own there here "
    "this that these those one two four five six seven eight nine ten eleven twelve twenty thirty forty fifty "
    "hundred thousand million monday tuesday wednesday thursday friday saturday sunday january february march "
    "april may june july august september october november december morning afternoon evening night today "
    "yesterday tomorrow weekend school store shop market park library bakery office zoo beach lake river city "
    "town street road trip party birthday holiday vacation lunch dinner breakfast snack money budget salary wage "
    "interest loan savings account bank stock let lets think step answer final write first then next finally "
    "therefore thus so we need find compute calculate multiply divide subtract add equals equal result means "
    "give reason problem solution explain check work out number line example respond reply assistant user system "
    "please thank thanks sure here is are the following question asked says said tells told wants wanted needs "
    "needed plans planned decides decided starts started stops stopped begins began ends ended uses used"
)
PUNCT = _words(". , ? ! : ; ' \" ( ) - + * / = < > % $ # ####")


def _problem(rng: random.Random) -> str:
    """One GSM8K-like problem and worked solution (with the dataset's <<a*b=c>> annotations and #### answer)."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice([w for w in ITEMS if w.endswith("s")])
    verb = rng.choice(VERBS)
    unit = rng.choice(UNITS)
    a, b, c = rng.randint(2, 99), rng.randint(2, 12), rng.randint(1, 50)
    total = a * b + c
    price = rng.randint(1, 40)
    question = rng.choice(
        (
            f"{name} {verb} {a} {item} each day for {b} days, and {other} {verb} {c} more {item}. "
            f"How many {item} is that altogether?",
            f"{name} has {b} boxes with {a} {item} in each box. {other} gives {name} {c} more. "
            f"How many {item} does {name} have now?",
            f"A store sells {item} for ${price} each. {name} buys {a} of them and pays with ${a * price + c}. "
            f"How much change does {name} get?",
            f"{name} walks {a} {unit} on Monday and {b} times as many on Tuesday. What is the total?",
        )
    )
    solution = rng.choice(
        (
            f"{name} gets {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.\n"
            f"Adding {c} gives {a * b} + {c} = <<{a * b}+{c}={total}>>{total}.\n#### {total}",
            f"The cost is {a} * {price} = <<{a}*{price}={a * price}>>{a * price} dollars.\n"
            f"The change is {c} dollars.\n#### {c}",
            f"First, {a} * {b} = {a * b}. Then {a * b} + {c} = {total}. So the answer is {total:,}.\n#### {total:,}",
        )
    )
    return f"{question}\n{solution}"


def corpus(lines: int = 12000) -> list[str]:
    rng = random.Random(SEED)
    lexicon = sorted({*NAMES, *ITEMS, *UNITS, *VERBS, *WORDS})
    text = [" ".join(f"{w} {w.capitalize()} {w}." for w in lexicon[i : i + 8]) for i in range(0, len(lexicon), 8)]
    text *= 3  # every word often enough to earn its merges (min_frequency)
    text += [_problem(rng) for _ in range(lines)]
    text += [" ".join(rng.choices(lexicon + PUNCT, k=24)) for _ in range(lines // 4)]
    return text


def build(out_dir: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # digits one by one, as GLM does, so numbers never merge into multi-digit tokens
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    # The corpus runs out of merges before VOCAB_SIZE. A random-weight model samples every id of its
    # vocabulary, and vLLM must detokenize each one, so the rest is filled with reserved special tokens.
    learned = tokenizer.get_vocab_size()
    if learned > VOCAB_SIZE:
        raise SystemExit(f"the trainer made {learned} tokens, more than VOCAB_SIZE={VOCAB_SIZE}")
    tokenizer.add_special_tokens(
        [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(VOCAB_SIZE - learned)]
    )
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation = {"eos_token_id": [ids[t] for t in STOP_TOKENS], "pad_token_id": ids[EOS]}
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0]) if argv else Path(__file__).resolve().parent / "models" / "glm5_small"
    # build beside, then move each file, so an interrupted run leaves the committed files intact
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.is_dir() else None) as tmp:
        build(Path(tmp))
        out.mkdir(parents=True, exist_ok=True)
        for path in sorted(Path(tmp).iterdir()):
            path.replace(out / path.name)
    print(f"{out}: tokenizer.json, tokenizer_config.json, generation_config.json ({VOCAB_SIZE} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
