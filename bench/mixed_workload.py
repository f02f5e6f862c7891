"""A mixed workload for the capacity-bound real-vLLM benchmark (issue #11), deterministic by seed:

- RAG users over a few shared documents: every request is one of the documents plus a new question (a
  one-turn conversation), so the documents are the shared prefixes;
- agent loops: a task, then every turn appends the model's answer and a tool result (of varying size), so
  the context grows by the tool output each turn;
- multi-turn chat: the sessions of ``bench.chat_workload``.

A client is a list of ``Session``s run one after another (``chat_workload.run_clients``); all clients run
concurrently. ``working_set`` renders every request's prompt with the model's chat template (placeholder
answers of ``max_tokens`` tokens) and counts the distinct full KV blocks over all of them: the tokens a
cache would need to hold to serve every request's prefix from memory.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from bench.chat_workload import Session, TextMaker, make_sessions
from bench.replay_workloads import chained_hashes, prefix_hit_rate


@dataclass
class MixSpec:
    rag_docs: int = 3
    rag_users: int = 4
    rag_questions: int = 4  # requests per RAG user
    doc_tokens: int = 1000
    question_tokens: int = 60
    agents: int = 3
    agent_turns: int = 5
    task_tokens: int = 300
    tool_tokens: int = 300  # mean tool result; each one is 0.5x-1.5x this
    chats: int = 4
    chat_turns: int = 4
    first_tokens: int = 800
    turn_tokens: int = 300


@dataclass
class Client:
    cid: str
    kind: str  # "rag" | "agent" | "chat"
    sessions: list[Session] = field(default_factory=list)


def make_mixed(tokenizer_path: str, spec: MixSpec, seed: int = 0) -> list[Client]:
    """The clients of the mixed workload, interleaved by kind (so a stagger starts every kind early)."""
    tm = TextMaker(tokenizer_path, seed)
    rng = random.Random(seed + 1)
    docs = [f"Document {d}. " + tm.text(spec.doc_tokens) for d in range(spec.rag_docs)]
    rag_system = "You answer questions about the document the user gives, citing it. " + tm.text(32)
    rag = []
    for u in range(spec.rag_users):
        c = Client(f"rag-u{u}", "rag")
        for q in range(spec.rag_questions):
            doc = docs[rng.randrange(len(docs))] if docs else ""
            question = f"\n\nQuestion {q} from user {u}: " + tm.text(spec.question_tokens)
            c.sessions.append(Session(f"rag-u{u}-q{q}", rag_system, [doc + question]))
        rag.append(c)
    agents = []
    for a in range(spec.agents):
        system = f"You are agent {a}. Call tools and act on their results. " + tm.text(48)
        turns = [f"Task {a}: " + tm.text(spec.task_tokens)]
        for t in range(1, spec.agent_turns):
            size = max(1, int(spec.tool_tokens * rng.uniform(0.5, 1.5)))
            turns.append(f"Tool result {t} for agent {a}: " + tm.text(size))
        agents.append(Client(f"agent-{a}", "agent", [Session(f"agent-{a}", system, turns)]))
    chats = [
        Client(s.sid, "chat", [s])
        for s in make_sessions(
            tokenizer_path, spec.chats, spec.chat_turns, spec.first_tokens, spec.turn_tokens,
            seed=seed + 2, tag="chat-",
        )
    ]
    out: list[Client] = []
    for i in range(max(len(rag), len(agents), len(chats))):
        out += [group[i] for group in (chats, agents, rag) if i < len(group)]
    return out


def kinds(clients: list[Client]) -> dict[str, str]:
    """Session id -> kind, for every session of every client."""
    return {s.sid: c.kind for c in clients for s in c.sessions}


def render_prompts(tokenizer_path: str, clients: list[Client], answer_tokens: int) -> list[list[list[list[int]]]]:
    """Every request's prompt as token ids, as vLLM's chat endpoint renders it with the model's chat template:
    per client, per session, per turn (the conversation so far, placeholder answers of ``answer_tokens``)."""
    import jinja2
    from tokenizers import Tokenizer

    d = Path(tokenizer_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(cfg["chat_template"])
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    answer = TextMaker(tokenizer_path, 12345).text(answer_tokens)
    out = []
    for c in clients:
        sessions = []
        for s in c.sessions:
            messages, prompts = [{"role": "system", "content": s.system}], []
            for user in s.users:
                messages.append({"role": "user", "content": user})
                text = template.render(messages=messages, bos_token=cfg.get("bos_token", ""),
                                       eos_token=cfg.get("eos_token", ""), add_generation_prompt=True)
                prompts.append(tok.encode(text, add_special_tokens=False).ids)
                messages.append({"role": "assistant", "content": answer})
            sessions.append(prompts)
        out.append(sessions)
    return out


def working_set(tokenizer_path: str, clients: list[Client], block_size: int, answer_tokens: int) -> dict:
    """Distinct full blocks over every request's prompt (placeholder answers), and the prompts' sizes."""
    prompts = [ids for sessions in render_prompts(tokenizer_path, clients, answer_tokens)
               for turns in sessions for ids in turns]
    n = distinct_blocks(prompts, block_size)
    return {
        "distinct_blocks": n,
        "distinct_prefix_tokens": n * block_size,
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "max_prompt_tokens": max(map(len, prompts), default=0),
    }


def distinct_blocks(prompts: list[list[int]], block_size: int) -> int:
    """Distinct full blocks (chained, as vLLM's prefix cache keys them) over ``prompts``."""
    return len({h for ids in prompts for h in chained_hashes(ids, block_size)})


def lru_reference(tokenizer_path: str, clients: list[Client], block_size: int, capacity_blocks: int,
              answer_tokens: int, orders: int = 30, seed: int = 0) -> dict:
    """The hit rate (cached over prompt tokens, vLLM's rules) of one cache of ``capacity_blocks`` evicting
    the least recently used block first, the whole fleet's KV as one cache: a reference for routers in
    front of LRU engines of that total size (where one places a prefix mostly picks among partitions of
    it; not a strict bound: placement could keep one-off prompts away from hot prefixes). Clients run
    concurrently, so the order of requests is not fixed: the median, min and max over ``orders`` random
    interleavings (each client's requests in its order), and the unlimited ceiling. The blocks of running
    requests, which vLLM cannot evict, and outputs are not counted."""
    per_client = [[(chained_hashes(ids, block_size), len(ids)) for sessions in c for ids in sessions]
                  for c in render_prompts(tokenizer_path, clients, answer_tokens)]

    rng = random.Random(seed)
    rates = []
    for _ in range(orders):
        queues = [list(reversed(q)) for q in per_client if q]
        order = []
        while queues:
            q = rng.choice(queues)
            order.append(q.pop())
            if not q:
                queues.remove(q)
        rates.append(prefix_hit_rate(order, block_size, max(1, capacity_blocks)))
    rates.sort()
    return {"median": rates[len(rates) // 2], "min": rates[0], "max": rates[-1], "orders": orders,
            "capacity_blocks": capacity_blocks, "ceiling": prefix_hit_rate([r for q in per_client for r in q], block_size)}


def kv_blocks_for(distinct_blocks: int, ratio: float, block_size: int, max_model_len: int) -> int:
    """Blocks per server so that the working set is ``ratio`` x one server's cache; vLLM needs at least
    one block more than ``max_model_len`` takes."""
    need = -(-max_model_len // block_size) + 1
    return max(need, int(round(distinct_blocks / ratio)))
