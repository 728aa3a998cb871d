"""Shared fixtures: tiny random backbones saved to disk (no hub), and the packaged MiniLM."""

from __future__ import annotations

import argparse
import compileall
import functools
import gc
import inspect
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

# One torch thread per test process and per process a test starts (set before torch is imported): one pytest-xdist
# worker runs per core, and workers with a thread per core oversubscribe the cores (torch's threads wait on each other).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, BertTokenizerFast  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Byte-compiled once: under PYTHONDONTWRITEBYTECODE (CI) each process would compile every module it imports again.
compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "st_prompts"), quiet=1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = (
    "the a man woman plays guitar piano dog cat runs sits on mat park this sentence means is are "
    "and of to in with playing music happy sad big small red blue green house car tree water food "
    ": \" . , ! ?"
).split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

#: The tiny shape of every architecture, and the options of the others: grouped-query decoders, ModernBERT with one
#: global and two local (sliding-window) layers, and two that compute attention themselves.
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
GROUPED = dict(TINY, num_key_value_heads=2)
OTHER_CONFIGS = {
    "camembert": TINY, "mpnet": TINY, "deberta-v2": TINY, "llama": GROUPED, "mistral": GROUPED, "qwen2": GROUPED,
    "qwen3": dict(GROUPED, head_dim=8), "gemma3_text": dict(GROUPED, head_dim=8, sliding_window=4),
    "modernbert": dict(TINY, num_hidden_layers=3, global_attn_every_n_layers=3, local_attention=4, cls_token_id=2,
                       sep_token_id=3, bos_token_id=2, eos_token_id=3),
}
#: Causal decoders among them.
DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def tiny_config(model_type: str, vocab_size: int, max_positions: int = 64):
    common = dict(vocab_size=vocab_size, pad_token_id=0, max_position_embeddings=max_positions)
    if model_type == "distilbert":
        return AutoConfig.for_model(model_type, dim=32, n_layers=2, n_heads=4, hidden_dim=64, **common)
    options = OTHER_CONFIGS.get(model_type, TINY)
    if model_type in ("albert", "electra"):
        options = dict(options, embedding_size=32)
    return AutoConfig.for_model(model_type, **options, **common)


def make_tiny_backbone(path, model_type: str = "bert", max_positions: int = 64, seed: int = 0, head: bool = False,
                       dropout: float | None = None, padding_side: str = "right") -> str:
    """Save a randomly initialised tiny backbone + a small WordPiece tokenizer to ``path``; return the path.

    ``dropout`` sets the hidden and attention dropout (default: the config class's); ``padding_side`` the
    tokenizer's (decoders are served with either).
    """
    os.makedirs(path, exist_ok=True)
    tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(SPECIAL + WORDS)}, do_lower_case=True,
                                  padding_side=padding_side)
    assert tokenizer.convert_tokens_to_ids("guitar") == SPECIAL.index("[MASK]") + 1 + WORDS.index("guitar")
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = tiny_config(model_type, len(SPECIAL) + len(WORDS), max_positions)
    if dropout is not None:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = dropout
    (AutoModelForMaskedLM if head else AutoModel).from_config(config).save_pretrained(path)
    return str(path)


FIXTURES = Path(__file__).parent / "fixtures"

#: A few short sentences: the training data of the tiny runs (`data_dir`).
SENTENCES = ["the man plays guitar .", "a dog runs in the park", "the cat sits on the mat", "this is happy music",
             "a woman plays piano", "the big red car", "green tree and blue water", "the sad dog sits"]


@pytest.fixture
def data_dir(tmp_path):
    """A --data-dir of SENTENCES (Wikipedia sentences, NLI triplets) and the SentEval fixtures."""
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "wiki_sentences.txt").write_text("\n".join(SENTENCES) + "\n")
    rows = ["sent0,sent1,hard_neg"] + [f"{a},{b},{c}" for a, b, c in zip(SENTENCES, SENTENCES[1:], SENTENCES[2:])]
    (tmp_path / "train" / "nli_triplets.csv").write_text("\n".join(rows) + "\n")
    shutil.copytree(FIXTURES / "senteval", tmp_path / "senteval")
    return tmp_path


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> str:
    return make_tiny_backbone(tmp_path_factory.mktemp("tiny-bert"), "bert")


@pytest.fixture(scope="session")
def tiny_backbones(tmp_path_factory):
    """A function ``(model_type, **kw) -> path`` caching tiny backbones per session."""
    cache = {}

    def get(model_type: str, **kwargs) -> str:
        key = (model_type, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = make_tiny_backbone(tmp_path_factory.mktemp(model_type), model_type, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def minilm_path() -> str:
    from st_prompts.utils import packaged_minilm_path

    return packaged_minilm_path()


@pytest.fixture(scope="session")
def minilm(minilm_path):
    """The packaged all-MiniLM-L6-v2 on CPU, one for the session: tests only encode with it, never change it."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu")


def _freeze_heap() -> None:
    """``gc.freeze`` after a collection: the ``gc.collect()`` sentence-transformers and accelerate run after each
    training or evaluation then skips the millions of objects a test process holds."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """The heap frozen again before each test file (:func:`_freeze_heap`)."""
    _freeze_heap()


@pytest.fixture(autouse=True)
def _detach_cli_log_handler():
    """``st_prompts.cli.main`` logs to the ``sys.stderr`` of its call (pytest's capture of one test): detach that
    handler after each test, so that later tests never log into a closed capture."""
    yield
    from st_prompts import cli

    cli.reset_output()


@pytest.fixture(scope="session")
def cached_gguf():
    """SmolLM2's GGUF file parsed, and gguf's tensor-name map built, once per process (a ``smollm2`` load in half the
    time)."""
    import gguf

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


# ---------------------------------------------------------------------------------------------- a tiny causal LM
LLM_WORDS = ("the a man dog cat plays runs sits park music is on in and of it what you know about sentence answer "
             "objectively make sure your answers are no more than four sentences contain important information . , "
             "1 2 ) : \" user assistant system").split()
LLM_SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


@pytest.fixture(scope="session")
def tiny_llm():
    """A randomly initialised tiny LLaMA and a word-level tokenizer with a chat template (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(LLM_SPECIAL + LLM_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval(), tokenizer


@pytest.fixture(scope="session")
def tiny_llm_path(tiny_llm, tmp_path_factory) -> str:
    """:func:`tiny_llm` saved to a folder (what ``--llm PATH`` reads)."""
    path = tmp_path_factory.mktemp("tiny-llm")
    model, tokenizer = tiny_llm
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------------------------------------- models
def st_model(encoder, pooling: str | list = "mean", **kwargs):
    """A CPU ``SentenceTransformer`` of ``encoder`` (a module; or a backbone path, read by a plain ``Transformer``
    with ``kwargs``) and a ``Pooling`` of its dimension (``pooling``: a mode, or a pooling module)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    if isinstance(encoder, (str, Path)):
        encoder = Transformer(str(encoder), **kwargs)
    if isinstance(pooling, (str, list)):
        pooling = Pooling(encoder.get_embedding_dimension(), pooling_mode=pooling)
    return SentenceTransformer(modules=[encoder, pooling], device="cpu")


def encode(model, texts, **kwargs) -> torch.Tensor:
    """``model.encode(texts)`` as one tensor (``kwargs``: encode's options)."""
    return model.encode(list(texts), convert_to_tensor=True, **kwargs)


def edit_json(path, change) -> None:
    """Rewrite the JSON file ``path`` with ``change(data)`` (or ``data``, changed in place, where it returns None)."""
    data = json.loads(Path(path).read_text())
    Path(path).write_text(json.dumps(change(data) or data))


def randomise_prompts(encoder, seed: int | None = 0):
    """``encoder`` with every prompt parameter drawn from N(0, 1) (``seed``: torch's seed first): trained-looking
    prompts that move every output clearly. Returns ``encoder``."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in encoder.prompt_parameters():
            parameter.normal_()
    return encoder


def random_prefix(path, prefix_length: int = 3, **kwargs):
    """``PromptedTransformer(path, prefix_length, **kwargs)`` (seed 0) with its prefix embedding drawn from N(0, 1): a
    prefix large enough to move every output clearly (a gate, if any, stays closed)."""
    from st_prompts import PromptedTransformer

    torch.manual_seed(0)
    encoder = PromptedTransformer(str(path), prefix_length=prefix_length, **kwargs)
    with torch.no_grad():
        encoder.prefix_encoder.embedding.weight.normal_()
    return encoder


def prompted_model(path, pooling: str = "mean", randomise: bool = False, **kwargs):
    """``st_model`` of a ``PromptedTransformer(path, **kwargs)`` (seed 0), its prompts random if ``randomise``."""
    from st_prompts import PromptedTransformer

    torch.manual_seed(0)
    encoder = PromptedTransformer(str(path), **kwargs)
    return st_model(randomise_prompts(encoder, None) if randomise else encoder, pooling)


def random_bank(path, pooling: str = "mean", **sets):
    """``st_model`` of a bank on the backbone ``path`` with the prompt ``sets`` (name -> a prefix length, or the
    set's options), seed 0, every prompt parameter drawn from N(0, 1): trained-looking sets that move every row."""
    from st_prompts import PromptedTransformer

    torch.manual_seed(0)
    options = {name: value if isinstance(value, dict) else {"prefix_length": value} for name, value in sets.items()}
    encoder = PromptedTransformer(str(path), prefix_length=None, prompt_sets=options)
    with torch.no_grad():
        for parameter in encoder.prompt_sets.parameters():
            parameter.normal_()
    return st_model(encoder, pooling)


def save_plain(path, backbone: str, pooling: str = "mean", **kwargs) -> Path:
    """Save an ordinary sentence-transformers model (``Transformer(backbone)`` + pooling) to ``path``; return it."""
    st_model(backbone, pooling, **kwargs).save(str(path))
    return Path(path)


# ---------------------------------------------------------------------------------------------- model stand-ins
class LookupModel:
    """A SentenceTransformer stand-in: each sentence maps to the fixed vector of ``table``; counts its calls."""

    similarity_fn_name = "cosine"

    def __init__(self, table):
        self.table = table
        self.calls = 0

    def vectors(self, inputs) -> np.ndarray:
        return np.stack([self.table[s] for s in inputs])

    def encode(self, inputs, convert_to_tensor=False, **kwargs):
        self.calls += 1
        arr = self.vectors(inputs).astype(np.float32)
        return torch.from_numpy(arr) if convert_to_tensor else arr

    encode_query = encode
    encode_document = encode


class HashModel(LookupModel):
    """A SentenceTransformer stand-in: a random vector per sentence, seeded by ``seed`` and the sentence."""

    def __init__(self, seed: int = 7, dim: int = 8):
        super().__init__({})
        self.seed, self.dim = seed, dim

    def vectors(self, inputs) -> np.ndarray:
        return np.stack([np.random.default_rng([self.seed, *map(ord, s)]).normal(size=self.dim) for s in inputs])


def write_stsb(root, rows, fmt: str = "{:.3f}") -> Path:
    """STS-B's three SentEval files under ``root/STS/STSBenchmark``, each holding ``rows`` of (score, a, b)."""
    folder = Path(root) / "STS" / "STSBenchmark"
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"main-captions\tMSRvid\t2012test\t{i:04d}\t{fmt.format(score)}\t{a}\t{b}\n"
                    for i, (score, a, b) in enumerate(rows))
    for name in ("sts-train.csv", "sts-dev.csv", "sts-test.csv"):
        (folder / name).write_text(lines, encoding="utf-8")
    return folder


# ---------------------------------------------------------------------------------------------- the files' order
#: Wall seconds of the slowest test files (on one pytest-xdist worker, two cores), handed out first, longest first:
#: pytest-xdist's own order (most tests first) gave them out last, leaving one worker busy while the other idled.
SLOW_FILES = {"test_docs_commands.py": 71, "test_search_ann.py": 46, "test_serving.py": 46, "test_hub_bounds.py": 40,
              "test_embed.py": 38, "test_serving_devices.py": 36, "test_import_graph.py": 34,
              "test_vector_db.py": 32, "test_data_safety.py": 27, "test_gpu_benchmark.py": 25,
              "test_cli_hostile.py": 25, "test_hostile_indexes.py": 24, "test_distributed.py": 24,
              "test_decoder_backbone.py": 23, "test_bank_safety.py": 20, "test_serving_hardening.py": 20,
              "test_readme_examples.py": 19, "test_ski_generation.py": 18, "test_demo.py": 18,
              "test_architectures.py": 17, "test_serving_workers.py": 17, "test_diffaug.py": 15}


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: hand files out in the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))  # stable: each file's tests stay in order


# ---------------------------------------------------------------------------------------------- a command's process
def pytest_collection_finish(session) -> None:
    """Once the test modules are imported: the heap frozen, then :class:`CLIProcess`'s warm process started."""
    _freeze_heap()
    WarmProcesses.start()


class WarmProcesses:
    """A process forked once the test modules are imported (about 12 s of CPU in a fresh interpreter), before any test
    and before gRPC is loaded (a fork after that aborts in gRPC's fork handler). It forks a child per command asked
    over a Unix socket (stdin, stdout, stderr passed as descriptors), and reports each one's pid, then exit status."""

    control = None  # this test process's end of the warm process's socket

    @classmethod
    def start(cls) -> None:
        if cls.control is not None or any(name.split(".")[0] == "grpc" for name in sys.modules):
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if os.fork() == 0:
            code = 0
            try:
                ours.close()
                cls._serve(theirs)
            except BaseException:  # noqa: BLE001 - nobody reads it: the process ends
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        cls.control = ours

    @staticmethod
    def _serve(control) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C of the test run ends the tests, which close the socket
        children = {}  # pid -> the socket its status goes to
        while True:
            ready, _, _ = select.select([control], [], [], 0.02 if children else None)
            if ready:
                message, fds, _, _ = socket.recv_fds(control, 1 << 20, 4)
                if not message:  # the test process ended
                    return
                request = json.loads(message)
                status = socket.socket(fileno=fds[3])
                pid = os.fork()
                if pid == 0:
                    control.close()
                    for other in children.values():
                        other.close()
                    status.close()
                    _become_command(request, fds[:3])
                for fd in fds[:3]:
                    os.close(fd)
                status.sendall(f"pid {pid}\n".encode())
                children[pid] = status
            while children:
                pid, code = os.waitpid(-1, os.WNOHANG)
                if not pid:
                    break
                status = children.pop(pid)
                try:
                    status.sendall(f"exit {os.waitstatus_to_exitcode(code)}\n".encode())
                except OSError:  # the test stopped listening
                    pass
                status.close()


def _become_command(request: dict, fds: list[int]) -> None:
    """In a forked child: ``fds`` as stdin, stdout and stderr, the request's ``cwd`` and whole ``env``, then run
    ``st-prompts ARGV`` (or ``python -c CODE ARGV``) and exit with its status (never returns)."""
    argv, env, cwd, status = request["argv"], request["env"], request["cwd"], 1
    try:
        if request["session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for number in (signal.SIGTERM, signal.SIGHUP):  # SIGPIPE stays ignored, as Python starts it
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        old_out = sys.stdout
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.stdin = open(0, closefd=False)
        sys.argv = ["-c", *argv] if request.get("code") is not None else ["st-prompts", *argv]
        logging.getLogger().handlers.clear()  # pytest's capture handlers
        for logger in list(logging.Logger.manager.loggerDict.values()):  # transformers' own, on pytest's
            for handler in getattr(logger, "handlers", []):  # captured stream: on the child's now
                if type(handler) is logging.StreamHandler:
                    handler.setStream(sys.stdout if handler.stream is old_out else sys.stderr)
        try:
            if request.get("code") is None:
                from st_prompts.cli import main

                status = main(list(argv))
            else:
                exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
                status = 0
        except SystemExit as exc:  # as an interpreter ends on it: None is 0, anything else printed and 1
            status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child's last word, then its exit
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status if isinstance(status, int) else 1)


class CLIProcess:
    """``st-prompts ARGV`` (or, with ``code``, ``python -c CODE ARGV``) forked by :class:`WarmProcesses`, with
    ``subprocess.Popen``'s arguments (``env`` the whole environment) and interface; where no warm process runs (gRPC
    was loaded before collection), a fresh interpreter."""

    def __new__(cls, argv: list[str], env: dict[str, str], stdout=None, stderr=None, text: bool = True,
                cwd: str | None = None, start_new_session: bool = False, code: str | None = None):
        if WarmProcesses.control is None:
            command = ["-m", "st_prompts.cli"] if code is None else ["-c", code]
            return subprocess.Popen([sys.executable, *command, *argv], env=env, stdout=stdout, stderr=stderr,
                                    text=text, cwd=cwd, start_new_session=start_new_session)
        return super().__new__(cls)

    def __init__(self, argv: list[str], env: dict[str, str], stdout=None, stderr=None, text: bool = True,
                 cwd: str | None = None, start_new_session: bool = False, code: str | None = None) -> None:
        opened, reads = [], {}

        def end(target, name: str, default: int) -> int:
            if target == subprocess.PIPE:
                read, write = os.pipe()
                reads[name] = read
                opened.append(write)
                return write
            if target == subprocess.DEVNULL:
                opened.append(os.open(os.devnull, os.O_WRONLY))
                return opened[-1]
            return target.fileno() if target is not None else default

        null = os.open(os.devnull, os.O_RDONLY)
        opened.append(null)
        out = end(stdout, "stdout", 1)
        err = out if stderr == subprocess.STDOUT else end(stderr, "stderr", 2)
        self._status, theirs = socket.socketpair()
        try:
            request = json.dumps({"argv": [str(a) for a in argv], "env": dict(env), "cwd": str(cwd or os.getcwd()),
                                  "session": start_new_session, "code": code}).encode()
            socket.send_fds(WarmProcesses.control, [request], [null, out, err, theirs.fileno()])
        finally:
            theirs.close()
            for fd in opened:
                os.close(fd)
        self._buffer = b""
        self.pid = int(self._line(None).split()[1])
        mode = "r" if text else "rb"
        self.stdout = open(reads["stdout"], mode) if "stdout" in reads else None
        self.stderr = open(reads["stderr"], mode) if "stderr" in reads else None
        self.returncode: int | None = None
        self.args = argv

    def _line(self, timeout: float | None) -> str | None:
        """The warm process's next line about this child, waiting up to ``timeout`` seconds (None: until it comes)."""
        while b"\n" not in self._buffer:
            if timeout is not None and not select.select([self._status], [], [], timeout)[0]:
                return None
            chunk = self._status.recv(256)
            if not chunk:
                raise RuntimeError("the warm process ended before it reported the command's exit")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line.split()[1])
            self._status.close()
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---------------------------------------------------------------------------------------------- errors in one line
def one_error_line(err, alone: bool = False) -> str:
    """The error line of a command's stderr ``err`` (a text, or pytest's ``capsys``: what it captured since last read),
    asserted: no traceback, exactly one ``: error:`` line, the last non-blank one and under 2,000 characters
    (``alone``: and no other line at all)."""
    if hasattr(err, "readouterr"):
        err = err.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if ": error:" in line]
    assert len(errors) == 1 and lines[-1] == errors[0] and len(errors[0]) < 2000, err[-3000:]
    assert not alone or len(lines) == 1, err[-3000:]
    return errors[0]


def run_cli(argv: list[str]) -> int:
    """``st_prompts.cli.main(argv)``'s exit status, returned or raised (argparse exits at parse time)."""
    from st_prompts.cli import main

    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code


def cli_out(argv: list, capsys) -> tuple[int, str, str]:
    """Run the command line ``argv`` in process: its exit status, stdout and stderr."""
    code = run_cli(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_error(argv: list, capsys, status: int = 2, alone: bool = False) -> str:
    """Run the command line ``argv`` in process; assert it exits with ``status`` and prints one error line
    (:func:`one_error_line`), and return that line."""
    capsys.readouterr()
    code = run_cli(argv)
    captured = capsys.readouterr()
    assert code == status, (argv, code, captured.err[-3000:])
    return one_error_line(captured.err, alone)


def parser_walk(parser, path: tuple[str, ...] = ("st-prompts",)):
    """``(path, parser)`` of ``parser`` and of each of its sub-commands, nested ones included, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parser_walk(sub, (*path, name))


def one_line_message(error) -> str:
    """The message of an exception (or ``pytest.raises``' info), asserted to be one line without a traceback."""
    message = str(getattr(error, "value", error))
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


def http_error(response, status: int | tuple[int, ...] | None = None) -> str:
    """The message of a server's error answer, asserted: the ``status`` (one of them; None: any 4xx), an OpenAI error
    object, a message of one line under 1,000 characters without a traceback."""
    statuses = (status,) if isinstance(status, int) else status or tuple(range(400, 500))
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    message = error["message"]
    assert message and "\n" not in message and "Traceback" not in message and len(message) <= 1000, message[:2000]
    return message


# ---------------------------------------------------------------------------------------------- an independent path
def transformers_cache(model: torch.nn.Module, values) -> dict:
    """The keyword argument under which ``model`` (a transformers encoder) takes a key/value cache, holding the prefix
    ``values`` (a ``PrefixDraw`` or a dense ``(2L, batch, heads, l, head_dim)`` tensor) in transformers' own
    ``DynamicCache``: PEFT's prefix tuning, an independent reference for st_prompts' attention path."""
    from transformers import DynamicCache

    dense = values if isinstance(values, torch.Tensor) else values.dense()
    cache = DynamicCache()
    for layer in range(dense.shape[0] // 2):
        cache.update(dense[2 * layer], dense[2 * layer + 1], layer)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def through_transformers_cache(encoder, features: dict) -> torch.Tensor:
    """``encoder(features)["token_embeddings"]`` computed by transformers' cache path instead of st_prompts' attention
    functions: the pass runs as usual up to the backbone, which is then called with the prefix draw in a
    ``DynamicCache`` and the prefix mask in front of the attention mask (ungated prefixes only)."""
    from st_prompts.prompts.injection import PREFIX_KWARG

    backbone = encoder.auto_model
    original = backbone.forward
    out = {}

    def by_cache(**kwargs):
        injection = kwargs.pop(PREFIX_KWARG)
        assert injection.gate is None and injection.rows is None, "a cache carries one ungated prefix"
        mask = kwargs.pop("attention_mask")
        length = injection.prefix[0].shape[2]
        prefix_mask = injection.visible if injection.visible is not None else mask.new_ones(mask.shape[0], length)
        kwargs["attention_mask"] = torch.cat([prefix_mask.to(mask.dtype).expand(mask.shape[0], -1), mask], dim=1)
        result = original(**kwargs, **transformers_cache(backbone, injection.draw))
        out["token_embeddings"] = result.last_hidden_state
        return result

    backbone.forward = by_cache
    try:
        encoder(features)
    finally:
        del backbone.forward
    return out["token_embeddings"]
