"""Shared pieces of the four algorithm scripts: group advantages, log-prob utilities, plumbing.

Only what two or more scripts use lives here; each script writes its own loss. The equations:

    group_advantages        A_i = (r_i − mean_g r) / (std_g r + ε)  (GRPO's group-relative adv.)
    zero_variance_fraction  share of groups with std_g r = 0 (A ≡ 0, no policy gradient)
    token_logprobs          log π(y_t | y_<t) from logits
    kl_penalty              k1 = −d, k2 = d²/2, k3 = e^d − d − 1,  d = log π_ref − log π_θ
                            (GRPO's KL to the reference)

Also what every loop touches: sampling with the sampler's own log-probs, token-bounded
micro-batches with π_old and π_ref scored once (scored_micro_batches), mini-batches, the
precision, seeds. Plumbing (processes and their gradient all-reduce, flags, models, logging,
checkpoints, sweeps) lives in utils/; this module imports no other module of the project.
"""

import copy
import dataclasses
import random

import numpy as np
import torch

# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards, group_size, scale="group", unbiased=True, eps=1e-4):
    """A_i = (r_i − mean_g) / (std_g + ε) over contiguous groups of `group_size` (GRPO).

    rewards: flat (B·G,) tensor, the G samples of one prompt next to each other. ε = 1e-4 as the
    official image Flow-GRPO (verl's default is 1e-6; either is negligible beside a std of 0/1
    rewards, and an all-equal group is handled exactly below).
    scale="group": divide by each group's std; scale="global": by the whole batch's std (the
    official image Flow-GRPO's `global_std`); scale="none": Dr. GRPO, A = r − mean_g.
    unbiased=True: the sample std (Bessel, ÷(G−1)), as TRL and verl compute it; unbiased=False: the
    population std (÷G), as RC-GRPO's σ_g (App. A.2) and the official image Flow-GRPO (np.std).
    A group whose rewards are all equal gets exact zeros (not the rounding noise of r − mean), so
    it carries no policy gradient and never a NaN.
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} >= 2")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; fix the reward function (no silent NaN)")
    grouped = rewards.float().view(-1, group_size)  # (B, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True, unbiased=unbiased) + eps)
    elif scale == "global":
        centered = centered / (grouped.std(unbiased=unbiased) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'global' or 'none', got {scale!r}")
    flat = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centered), centered).view(-1)


def zero_variance_fraction(rewards, group_size):
    """Share of groups whose G rewards are all equal: those groups give A = 0 (GRPO)."""
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1).float().mean().item()


# ----------------------------------------------------------------------------- log-probs


def token_logprobs(logits, labels):
    """log π(y_t) = logit[y_t] − logsumexp(logits), in fp32, shape (B, T).

    Gathers the label logit and subtracts the log-normaliser instead of building log_softmax: the
    only (B, T, V) float tensor is the one logsumexp needs (none extra when logits are already
    fp32).
    """
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
    return picked - torch.logsumexp(logits.float(), dim=-1)


def masked_mean(x, mask, dim=None):
    """Σ x·m / Σ m over `dim` (all elements when None); an all-zero mask gives 0, not NaN."""
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def completion_logprobs(model, input_ids, attention_mask, completion_len, *, temperature=1.0):
    """log π(y_t | x, y_<t) of the last `completion_len` tokens of padded sequences → (B, W).

    Only the completion's logits are built (`logits_to_keep`), so a long prompt costs no
    vocabulary-sized memory. With a sampling temperature T ≠ 1 the policy is softmax(logits / T), so
    that is what is scored. Position ids follow the attention mask, as `generate` sets them for
    left-padded prompts.
    """
    logp, _ = completion_forward(model, input_ids, attention_mask, completion_len, temperature)
    return logp


def completion_forward(
    model, input_ids, attention_mask, completion_len, temperature=1.0, output_hidden_states=False
):
    """One forward pass → (the completion's log-probs (B, W), the model's output)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=completion_len + 1,
        output_hidden_states=output_hidden_states,
    )
    logits = out.logits[:, :-1]  # position j scores token j + 1
    if temperature != 1.0:
        logits = logits / temperature
    return token_logprobs(logits, input_ids[:, -completion_len:]), out


def micro_batch_logprobs(model, mb, temperature=1.0):
    """log π(y_t | x, y_<t) of a micro-batch's completions → (B, W), each distinct prompt run once
    (`micro_batch_forward`)."""
    logp, _ = micro_batch_forward(model, mb, temperature)
    return logp


def micro_batch_forward(model, mb, temperature=1.0, prompt_states=False):
    """(log π of the completions (B, W), each row's prompt states (B, P, H) on `mb.prompt_mask`):
    the states (the last layer's, what FlowRL's log Z reads) only with `prompt_states`.

    One forward over the micro-batch's prefix tree: each node attends to itself and its ancestors
    at its depth's position, so every row sees exactly its own prompt and completion, and each
    shared prefix is computed once — the loss and gradient of packing every row whole, up to float
    rounding (a test). A completion token is scored by its predecessor's logits, which are the
    only ones built. The tree's mask is all a layer sees: a model whose attention is not over every
    earlier token (a row longer than its sliding window; chunked or linear attention) is refused
    with one line, not scored as it never computes."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    kinds, longest = cache_layer_kinds(model), int(mb.positions.max()) + 1
    window = model.config.sliding_window if DynamicSlidingWindowLayer in kinds else None
    if kinds - {DynamicLayer, DynamicSlidingWindowLayer} or (window and longest > window):
        raise SystemExit(
            f"error: a row of {longest} tokens needs attention over every earlier token, which "
            f"this model's does not give (its cache: {sorted(k.__name__ for k in kinds)}, sliding "
            f"window {window}); the prefix-tree forward needs full attention or rows in the window"
        )
    node = torch.arange(mb.tokens, device=mb.ids.device)
    allowed = (node[None, :] <= node[:, None]) & (node[:, None] < mb.ends[None, :])  # (N, N)
    allowed = allowed[None, None]  # [i, j]: j is i or one of its ancestors
    if model.config._attn_implementation == "eager":  # eager attention adds the mask to scores
        allowed = torch.zeros(allowed.shape, device=node.device).masked_fill(~allowed, -1e30)
    kept = torch.unique(mb.scored_by)  # sorted
    out = model(
        input_ids=mb.ids,
        attention_mask=allowed,
        position_ids=mb.positions,
        logits_to_keep=kept,
        output_hidden_states=prompt_states,
    )
    logits = out.logits[0, torch.searchsorted(kept, mb.scored_by)]  # (B, W, V)
    if temperature != 1.0:
        logits = logits / temperature
    states = out.hidden_states[-1][0, mb.prompt_nodes] if prompt_states else None
    return token_logprobs(logits, mb.completion_ids), states


def eos_token_ids(model, tokenizer):
    """Every id that ends a completion: the tokenizer's EOS and each one the checkpoint declares."""
    ids = {tokenizer.eos_token_id} | set(getattr(model, "stop_ids", ()))
    return sorted(i for i in ids if i is not None)


def generation_config(model, tokenizer, max_new_tokens, temperature, stop_at_eos=True):
    """The sampler, stated in full: plain multinomial sampling at T (greedy at T = 0), no
    top-k/top-p, no repetition penalty; nothing is inherited from the checkpoint but its EOS and pad
    ids. The temperature is applied by `SampledLogprobs`, the last logits processor, so generate's
    own temperature stays 1."""
    from transformers import GenerationConfig

    sampling = dict(temperature=1.0, top_k=0, top_p=1.0) if temperature > 0 else {}
    return GenerationConfig(  # explicit pad/EOS: nothing else comes from the checkpoint
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        repetition_penalty=1.0,
        num_beams=1,
        eos_token_id=eos_token_ids(model, tokenizer) if stop_at_eos else None,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **sampling,
    )


class SampledLogprobs:
    """A logits processor that runs last in `generate`: divides the logits by the temperature and
    records log softmax(scores)[sampled token], the sampler's own log-probability of each token it
    drew. One (B, V) tensor is kept at a time, never the whole (B, T, V) history that
    `output_scores` would hold. With `row_seeds` it draws each row's token itself, from that row's
    own generator, and leaves generate only that token: a row's sample then does not depend on which
    other rows share the call (one call per step, any number of ranks)."""

    def __init__(self, temperature, row_seeds=None):
        self.temperature, self.last, self.picked = temperature, None, []
        self.row_seeds, self.rngs = row_seeds, None

    def __call__(self, input_ids, scores):
        if scores.isnan().any():  # diverged weights: one line, not a sampler's traceback
            raise SystemExit(
                "error: the policy's logits are NaN (its weights diverged); lower --lr"
            )
        self.collect(input_ids)
        scores = scores / self.temperature
        self.last = torch.log_softmax(scores.float(), dim=-1)
        if self.row_seeds:
            self.rngs = self.rngs or [
                torch.Generator(scores.device).manual_seed(seed) for seed in self.row_seeds
            ]
            # one exponential draw per token, −log(1 − U) from a double U of the row's own
            # generator (on CPU, what exponential_ draws, bit for bit), the logarithm taken for all
            # rows at once; then one argmax: the Gumbel-style trick that torch.multinomial itself
            # uses for one sample, so the same tokens (a test)
            uniform = torch.empty(scores.shape, dtype=torch.float64, device=scores.device)
            for row, rng in zip(uniform, self.rngs):
                row.uniform_(generator=rng)
            noise = uniform.neg_().log1p_().neg_().float()
            drawn = (self.last.exp() / noise).argmax(dim=-1)
            keep = torch.full_like(scores, -float("inf"))
            scores = keep.scatter(1, drawn[:, None], scores.gather(1, drawn[:, None]))
        return scores

    def collect(self, input_ids):
        """Keep the log-prob of the token just appended (once more after `generate` returns)."""
        if self.last is not None:
            self.picked.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
            self.last = None


def generation_chunks(prompt_lengths, max_new_tokens, batch_rows, token_budget=0):
    """Contiguous ranges of prompts, one `generate` call each: at most `batch_rows` rows and, with
    a `token_budget`, rows × (longest prompt + max_new_tokens) ≤ budget, the padded size the call
    can reach (a prompt alone over the budget gets a call of its own)."""
    chunks, lo, longest = [], 0, 0
    for i, length in enumerate(prompt_lengths):
        rows = i - lo + 1
        width = max(longest, length) + max_new_tokens
        too_big = rows > batch_rows or (token_budget and rows * width > token_budget)
        if too_big and i > lo:
            chunks.append(range(lo, i))
            lo, longest = i, 0
        longest = max(longest, length)
    if lo < len(prompt_lengths):
        chunks.append(range(lo, len(prompt_lengths)))
    return chunks


SHARED_PREFIX_MIN = 8  # tokens: a shorter common prefix stays in the rows (not worth a forward)


def shared_prefix_length(rows):
    """How many leading tokens all `rows` share, each keeping at least its last token."""
    longest = min(map(len, rows)) - 1
    return next((k for k in range(longest) if len({row[k] for row in rows}) > 1), longest)


@torch.no_grad()
def prompt_cache(model, prompts, pad_id, prompt_of, pasts=None):
    """The rows' (ids, attention mask, KV cache) for `generate`, each prompt token computed once:
    the prefix all prompts share (a chat template's system turn, at least SHARED_PREFIX_MIN
    tokens) once for them all, then each distinct prompt's rest but its last token, without
    padding (one forward per rest length), copied to the rows that sample from it (`prompt_of`:
    (B,) indices). A prompt whose first n tokens were computed before (`pasts`: per prompt, None
    or (n, each layer's (keys, values) of at least n positions), a dialogue's previous step)
    runs only its tokens after them, on their cache (kept off the accelerator: moved here for the
    call), one forward per such prompt. A row is laid out as that prefix, left padding, then the
    rest of its prompt; `generate` runs only each row's last prompt token. The cache is None, and
    `generate` runs the prompts whole, when every prompt is one token, and for a model whose cache
    drops positions (a sliding window): its rows are only left-padded, so a window covers what it
    covers for the prompt alone."""
    from transformers import DynamicCache

    whole = not keeps_every_position(model)
    shared = shared_prefix_length(prompts) if len(prompts) > 1 and not whole else 0
    shared = shared if shared >= SHARED_PREFIX_MIN else 0
    own = {i: past for i, past in enumerate(pasts or []) if past and past[0] > shared}
    fresh = [i for i in range(len(prompts)) if i not in own]
    rest = [p[shared:] for p in prompts]
    width = max(map(len, rest))
    ids = [prompts[0][:shared] + [pad_id] * (width - len(r)) + r for r in rest]
    attn = [[1] * shared + [0] * (width - len(r)) + [1] * len(r) for r in rest]
    ids, attn = torch.tensor(ids, device=model.device), torch.tensor(attn, device=model.device)
    if shared + width < 2 or whole:
        return ids[prompt_of], attn[prompt_of], None
    prefix = None
    if shared and fresh:
        prefix = model(input_ids=ids[:1, :shared], use_cache=True, logits_to_keep=1).past_key_values
    caches = []  # (prompts, their cache: prefix + rest but its last token)
    for length in sorted({len(rest[i]) for i in fresh}):  # new prompts: one forward per length
        rows = [i for i in fresh if len(rest[i]) == length]
        cache = copy.deepcopy(prefix)
        if cache is not None:
            cache.batch_repeat_interleave(len(rows))
        if length >= 2:
            run = torch.tensor([rest[i][:-1] for i in rows], device=model.device)
            positions = torch.arange(shared, shared + length - 1, device=model.device)
            cache = model(
                input_ids=run,
                position_ids=positions.expand(len(rows), -1),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).past_key_values
        caches.append((rows, cache))
    for i, (n, layers) in own.items():  # its first n tokens' keys and values, then the rest
        n = min(n, len(prompts[i]) - 1)
        past = [(k[:, :, :n].to(model.device), v[:, :, :n].to(model.device)) for k, v in layers]
        cache = DynamicCache(past, config=model.config)
        if n < len(prompts[i]) - 1:
            cache = model(
                input_ids=torch.tensor([prompts[i][n:-1]], device=model.device),
                position_ids=torch.arange(n, len(prompts[i]) - 1, device=model.device)[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).past_key_values
        caches.append(([i], cache))
    # every prompt's keys and values in its row's layout, masked slots zero
    order = torch.tensor([i for rows, _ in caches for i in rows]).argsort().to(model.device)
    cache = next(c for _, c in caches if c is not None)
    for layer, kept in enumerate(cache.layers):
        for name in ("keys", "values"):
            full = []
            for rows, c in caches:
                states = getattr(c.layers[layer], name) if c is not None else None
                heads, dim = getattr(kept, name).shape[1], getattr(kept, name).shape[3]
                if states is None:
                    states = getattr(kept, name).new_zeros(len(rows), heads, 0, dim)
                pad = states.new_zeros(len(rows), heads, shared + width - 1 - states.shape[2], dim)
                full.append(torch.cat([states[:, :, :shared], pad, states[:, :, shared:]], 2))
            setattr(kept, name, torch.cat(full)[order])
    cache.batch_select_indices(prompt_of)
    return ids[prompt_of], attn[prompt_of], cache


def cache_layer_kinds(model):
    """The classes of the model's cache layers: DynamicLayer keeps every position,
    DynamicSlidingWindowLayer a window, any other (chunked, indexed, linear attention) neither."""
    from transformers import DynamicCache

    return {type(layer) for layer in DynamicCache(config=model.config).layers}


def keeps_every_position(model):
    """Whether every layer of the model's cache holds every position, as the caches
    `prompt_cache` lays out and a dialogue keeps need."""
    from transformers.cache_utils import DynamicLayer

    return cache_layer_kinds(model) == {DynamicLayer}


@torch.no_grad()
def sample_completions(
    model,
    tokenizer,
    prompts,
    max_new_tokens,
    *,
    temperature=1.0,
    stop_at_eos=True,
    batch_rows=64,
    token_budget=0,
    precision="auto",
    row_seeds=None,
    dialogues=None,
):
    """Sample one completion per prompt → [(text, completion ids, the sampler's log-probs)].

    `generate` runs on at most `batch_rows` prompts at a time, and at most `token_budget` padded
    tokens (`generation_chunks`: bounded memory), with an explicit `generation_config`; the
    log-probs are the ones the sampler drew from (`SampledLogprobs`). A completion keeps its tokens
    up to and including the first EOS; the EOS is scored, so the policy learns to stop. Decoding
    uses only the kept ids (padding never reaches the text). Greedy (T = 0): log-probs are zeros.

    `dialogues`: per prompt, a dict the caller keeps for the prompt's dialogue. Each row leaves
    there the keys and values it computed (its prompt and completion tokens), in host memory, and
    the dialogue's next prompt runs only its tokens after the longest prefix it shares with them
    (`prompt_cache`). The rows keep at most what one call's cache may hold (`token_budget`, or
    without one the largest chunk's rows × (longest prompt + `max_new_tokens`)); a row past that
    keeps nothing; so does every row of a model with a sliding window.
    """
    from transformers import LogitsProcessorList

    model.eval()
    config = generation_config(model, tokenizer, max_new_tokens, temperature, stop_at_eos)
    config.return_dict_in_generate = True  # the sequences and the cache (for `dialogues`)
    stop = torch.tensor(config.eos_token_id or [], dtype=torch.long)
    out = []
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    chunks = generation_chunks(lengths, max_new_tokens, batch_rows, token_budget)
    keeping = bool(dialogues) and keeps_every_position(model)
    if keeping:  # the tokens they may keep: what one call's cache may hold
        widest = max(len(c) * (max(lengths[i] for i in c) + max_new_tokens) for c in chunks)
        budget = token_budget or widest
    for chunk in chunks:
        lo, hi = chunk.start, chunk.stop
        # each distinct prompt (the G copies of a group's) is prefilled once, its cache shared
        distinct = list(dict.fromkeys(prompts[lo:hi]))
        distinct_ids = tokenizer(distinct, add_special_tokens=False)["input_ids"]
        prompt_of = torch.tensor([distinct.index(p) for p in prompts[lo:hi]], device=model.device)
        pasts = None
        if keeping:  # a distinct prompt's dialogue: any of its rows' (checked against it)
            of_prompt = dict(zip(prompts[lo:hi], dialogues[lo:hi]))
            pasts = [computed_prefix(of_prompt[p], i) for p, i in zip(distinct, distinct_ids)]
        seeds = row_seeds[lo:hi] if row_seeds and temperature > 0 else None  # greedy draws nothing
        recorder = SampledLogprobs(temperature if temperature > 0 else 1.0, seeds)
        with training_autocast(model.device, precision):  # the precision the trainer scores in
            ids, attn, cache = prompt_cache(
                model, distinct_ids, tokenizer.pad_token_id, prompt_of, pasts
            )
            generated = model.generate(  # each rank decodes alone (a sharded model: gathered first)
                input_ids=ids,
                attention_mask=attn,
                past_key_values=cache,
                generation_config=config,
                logits_processor=LogitsProcessorList([recorder]),
                synced_gpus=False,
            )
        seq = generated.sequences
        recorder.collect(seq)
        completion = seq[:, ids.shape[1] :].cpu()
        logp = (
            torch.stack(recorder.picked, 1).cpu()
            if temperature > 0
            else torch.zeros(completion.shape)
        )
        is_stop = torch.isin(completion, stop)
        keep = ~((is_stop.cumsum(-1) - is_stop.long()) > 0)  # up to and including the first EOS
        if keeping:
            prompt_ids = [distinct_ids[i] for i in prompt_of.tolist()]
            budget = keep_computed(
                generated.past_key_values,
                attn,
                prompt_ids,
                completion,
                keep,
                dialogues[lo:hi],
                budget,
            )
        del generated, cache  # freed before the next chunk's are built
        for ids, row_logp, row_keep in zip(completion, logp, keep):
            ids = ids[row_keep]
            out.append(
                (tokenizer.decode(ids, skip_special_tokens=True), ids.tolist(), row_logp[row_keep])
            )
    return out


def computed_prefix(dialogue, prompt_ids):
    """(n, keys and values) for the first n tokens of `prompt_ids` that the dialogue's last call
    computed (the longest prefix the two share), or None."""
    computed = dialogue.get("ids", [])
    n = next(
        (k for k, (a, b) in enumerate(zip(computed, prompt_ids)) if a != b),
        min(len(computed), len(prompt_ids)),
    )
    return (n, dialogue["layers"]) if n else None


def keep_computed(cache, attn, prompt_ids, completion, keep, dialogues, budget):
    """Each row's keys and values out of `generate`'s cache (laid out as `prompt_cache` set the
    prompt: prefix, padding, rest; then one position per token fed back), without padding, into
    its dialogue's dict with the tokens they belong to: the prompt and the kept completion tokens
    that were fed back (all the call generated but its last step's), in host memory. A row past
    the `budget` tokens left keeps nothing. → the budget left."""
    width, fed = attn.shape[1], completion.shape[1] - 1
    for row, dialogue in enumerate(dialogues):
        dialogue.clear()
        n_fed = min(int(keep[row].sum()), fed)
        if len(prompt_ids[row]) + n_fed > budget:
            continue
        fed_back = torch.arange(width, width + n_fed, device=attn.device)
        positions = torch.cat([attn[row].nonzero()[:, 0], fed_back])  # only these are copied
        dialogue["ids"] = prompt_ids[row] + completion[row, :n_fed].tolist()
        dialogue["layers"] = [
            (
                layer.keys[row : row + 1, :, positions].cpu(),
                layer.values[row : row + 1, :, positions].cpu(),
            )
            for layer in cache.layers
        ]
        budget -= len(positions)
    return budget


def pack_completions(tokenizer, prompts, completions, device):
    """Left-padded prompts + right-padded completions → (ids (B, P+W), attention, mask (B, W)).

    The completion is the last W columns, so `completion_logprobs(..., completion_len=W)` scores
    exactly the model-written tokens (never prompts, observations or reward tokens); the mask marks
    the real ones."""
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    width = max(1, max(len(c) for c in completions))
    comp = torch.full((len(completions), width), tokenizer.pad_token_id)
    comp_mask = torch.zeros(len(completions), width, dtype=torch.long)
    for row, ids in enumerate(completions):
        comp[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        comp_mask[row, : len(ids)] = 1
    ids = torch.cat([enc["input_ids"], comp], 1)
    attn = torch.cat([enc["attention_mask"], comp_mask], 1)
    return ids.to(device), attn.to(device), comp_mask.float().to(device)


class PrefixTree:
    """Token sequences as one tree: each distinct prefix is one node, numbered in depth-first
    order, so a node's descendants follow it contiguously (`end[i]`: one past its last)."""

    def __init__(self):
        self.children, self.tokens = [{}], [None]  # node 0: the empty root, never computed

    def add(self, sequence):
        """Insert `sequence`; returns its nodes (one per token) in insertion numbering."""
        node, path = 0, []
        for token in sequence:
            children = self.children[node]
            if token not in children:
                children[token] = len(self.tokens)
                self.children.append({})
                self.tokens.append(token)
            node = children[token]
            path.append(node)
        return path

    def new_nodes(self, sequence):
        """How many nodes `add(sequence)` would create."""
        node = 0
        for k, token in enumerate(sequence):
            if token not in self.children[node]:
                return len(sequence) - k
            node = self.children[node][token]
        return 0

    def packed(self):
        """(tokens, depths, ends, new number of each insertion-numbered node) in depth-first
        order, the root left out."""
        size = len(self.tokens)
        order, ends, depth, stack = [], [0] * size, [-1] * size, [(0, False)]
        while stack:
            node, done = stack.pop()
            if done:
                ends[node] = len(order)
                continue
            order.append(node)
            stack.append((node, True))
            for child in reversed(self.children[node].values()):
                depth[child] = depth[node] + 1
                stack.append((child, False))
        number = [0] * size
        for k, node in enumerate(order):
            number[node] = k - 1
        kept = order[1:]
        tokens = [self.tokens[n] for n in kept]
        return tokens, [depth[n] for n in kept], [ends[n] - 1 for n in kept], number


def micro_batches(tokenizer, prompts, completions, token_budget):
    """Split rows into consecutive micro-batches whose prefix tree (`pack_micro_batch`: each
    distinct prefix of prompt + completion computed once) holds at most `token_budget` tokens, so a
    step's peak memory does not grow with the number of rollouts. A row longer than the budget gets
    a micro-batch of its own. Returns lists of row indices."""
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    batches, current, tree, size = [], [], PrefixTree(), 0
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completions)):
        sequence = list(prompt) + list(completion)
        if current and size + tree.new_nodes(sequence) > token_budget:
            batches.append(current)
            current, tree, size = [], PrefixTree(), 0
        size += tree.new_nodes(sequence)
        tree.add(sequence)
        current.append(row)
    return batches + [current] if current else batches


def split_minibatches(num_rows, minibatches):
    """Rows 0..num_rows−1 as `minibatches` disjoint, contiguous, near-equal slices (PPO-style
    epochs: one optimiser step per slice, π_old fixed for the whole rollout batch). A slice may be
    empty when there are fewer rows than slices; every rank still takes the step."""
    return [part.tolist() for part in np.array_split(np.arange(num_rows), minibatches)]


def place_logprobs(mask, logps):
    """Put each sample's sampling-time log-probs (a list of 1-D tensors) where `mask` marks its
    completion."""
    out = torch.zeros(mask.shape, device=mask.device)
    for row, logp in enumerate(logps):
        out[row, mask[row].bool()] = logp.to(mask.device)
    return out


@dataclasses.dataclass
class MicroBatch:
    """One token-bounded slice of a step's rows (`rows`) packed as a prefix tree: each distinct
    prefix of prompt + completion is one token of `ids` (1, N), at its depth (`positions`), whose
    subtree ends before `ends[i]`; `scored_by` (B, W): the node whose logits score each completion
    token (its predecessor); `prompt_nodes` (B, P) with `prompt_mask`: each row's prompt tokens;
    the completions right-padded (B, W) with their mask; and on the mask: the sampler's log-probs,
    π_old's (the trainer's own forward before any update) and π_ref's, each None when not asked
    for."""

    rows: list
    ids: torch.Tensor
    positions: torch.Tensor
    ends: torch.Tensor
    scored_by: torch.Tensor
    prompt_nodes: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor
    sampler_logp: torch.Tensor = None
    old_logp: torch.Tensor = None
    ref_logp: torch.Tensor = None

    @property
    def tokens(self):
        """The tokens its forward computes: each distinct prefix once."""
        return self.ids.shape[1]


def pack_micro_batch(tokenizer, prompts, completions, device, rows=()):
    """Rows as one MicroBatch: the prefix tree of their token sequences, so a prompt shared by
    several rows (a group's G completions, the replies to one demonstration), or the system
    prompt and documents that open every prompt, is computed once."""
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return pack_tree(prompt_ids, completions, tokenizer.pad_token_id or 0, device, rows)


def pack_tree(prompt_ids, completions, pad_id, device, rows=()):
    """`pack_micro_batch` on token ids."""
    tree = PrefixTree()
    paths = [tree.add(list(p) + list(c)) for p, c in zip(prompt_ids, completions)]
    tokens, depths, ends, number = tree.packed()
    num_rows, width = len(completions), max(1, max(len(c) for c in completions))
    prompt_width = max(len(p) for p in prompt_ids)
    completion_ids = np.full((num_rows, width), pad_id, dtype=np.int64)
    scored_by = np.zeros((num_rows, width), dtype=np.int64)
    prompt_nodes = np.zeros((num_rows, prompt_width), dtype=np.int64)
    for row, (path, prompt, completion) in enumerate(zip(paths, prompt_ids, completions)):
        nodes = [number[n] for n in path]
        plen, clen = len(prompt), len(completion)
        completion_ids[row, :clen] = completion
        scored_by[row, :clen] = nodes[plen - 1 : plen + clen - 1]  # each token's predecessor
        prompt_nodes[row, :plen] = nodes[:plen]
    mask = torch.arange(width) < torch.tensor([len(c) for c in completions])[:, None]
    prompt_mask = torch.arange(prompt_width) < torch.tensor([len(p) for p in prompt_ids])[:, None]
    return MicroBatch(
        list(rows),
        torch.tensor([tokens], device=device),
        torch.tensor([depths], device=device),
        torch.tensor(ends, device=device),
        torch.from_numpy(scored_by).to(device),
        torch.from_numpy(prompt_nodes).to(device),
        prompt_mask.long().to(device),
        torch.from_numpy(completion_ids).to(device),
        mask.float().to(device),
    )


def empty_micro_batch(pad_id, device):
    """A micro-batch of no rows (a one-token prompt, a masked-out one-token completion): what a
    rank with fewer micro-batches runs so that every rank of a sharded model runs as many."""
    mb = pack_tree([[pad_id]], [[pad_id]], pad_id, device)
    mb.mask.zero_()
    return mb


@dataclasses.dataclass
class Scoring:
    """How `scored_micro_batches` packs and scores a step's rows, fixed for a run: the tokenizer,
    the tokens each micro-batch computes (`token_budget`) and the device; the trainer `model`
    (None: pack only) and the frozen `reference` (None: `model` with its adapter off), with the
    sampling temperature and the precision their forwards score at; `with_reference`: score π_ref
    (only where a loss reads it: β > 0); `equal_count` (a sharded model, whose every forward and
    backward is a collective): maps this rank's number of micro-batches to the number every rank
    runs."""

    tokenizer: object
    token_budget: int
    device: torch.device
    model: torch.nn.Module = None
    reference: torch.nn.Module = None
    temperature: float = 1.0
    precision: str = "auto"
    with_reference: bool = True
    equal_count: object = None


def scored_micro_batches(prompts, completions, *, sampler_logps, scoring, rows=None, with_old=True):
    """A step's rows (or only `rows`, a mini-batch) as micro-batches of at most
    `scoring.token_budget` computed tokens (`micro_batches`, `pack_micro_batch`); MicroBatch.rows
    index the step's rows.

    Each carries the sampler's log-probs (`sampler_logps`, one 1-D tensor per row, or None) placed
    on its mask. When `scoring.model` is given: with `with_old`, π_old = the trainer's own no-grad
    forward of the same tokens in the same mode and precision as the update's (a bf16 `generate`
    rounds differently and stays a diagnostic only) — needed only where samples are reused
    (several mini-batches or epochs); an on-policy update leaves it None and takes its own
    logp.detach(), the same numbers without a second forward. With `scoring.with_reference`, π_ref
    (the frozen `reference`, else `model` with its adapter off). With `scoring.equal_count`, empty
    micro-batches are appended up to the count every rank runs."""
    tokenizer, device, model = scoring.tokenizer, scoring.device, scoring.model
    subset = list(range(len(prompts))) if rows is None else rows
    packed = []
    if subset:  # an empty mini-batch (fewer rows than mini-batches) has none
        local = micro_batches(
            tokenizer,
            [prompts[r] for r in subset],
            [completions[r] for r in subset],
            scoring.token_budget,
        )
        packed = [[subset[k] for k in rows_of_local] for rows_of_local in local]
    if scoring.equal_count:
        packed += [[]] * (scoring.equal_count(len(packed)) - len(packed))
    out = []
    for rows in packed:
        texts, ids = [prompts[r] for r in rows], [completions[r] for r in rows]
        if rows:
            mb = pack_micro_batch(tokenizer, texts, ids, device, rows)
        else:
            mb = empty_micro_batch(tokenizer.pad_token_id or 0, device)
        if sampler_logps is not None:
            mb.sampler_logp = place_logprobs(mb.mask, [sampler_logps[r] for r in rows])
        if model is not None:
            with torch.no_grad(), training_autocast(device, scoring.precision):
                if with_old:
                    mb.old_logp = micro_batch_logprobs(model, mb, scoring.temperature)
                if scoring.with_reference:
                    mb.ref_logp = reference_logprobs(
                        model, scoring.reference, mb, scoring.temperature
                    )
        out.append(mb)
    return out


@torch.no_grad()
def reference_logprobs(model, reference, mb, temperature=1.0):
    """log π_ref of a micro-batch's completions: a frozen copy when given, else `model` with its
    LoRA adapter disabled."""
    if reference is not None:
        return micro_batch_logprobs(reference, mb, temperature)
    with model.disable_adapter():
        return micro_batch_logprobs(model, mb, temperature)


def old_logprobs(mb, logp):
    """log π_old (B, W): π_θ before this rollout batch's first update. Where samples are reused
    it was scored before that update (`scored_micro_batches`, with_old); on-policy it is this very
    forward, `logp`, detached — the same numbers without a second forward."""
    return logp.detach() if mb.old_logp is None else mb.old_logp


def sampler_gap(mb, old_logp):
    """max_t |log π_old − log π_sampler| over a micro-batch's completion tokens: how far the
    trainer's forward is from what `generate` drew with (a diagnostic; bf16 kernels round
    differently); 0 where the sampler's log-probs are not kept."""
    if mb.sampler_logp is None:
        return 0.0
    return ((old_logp - mb.sampler_logp) * mb.mask).abs().max().item()


def check_finite(value, step, what="loss"):
    """A NaN or inf loss (or gradient norm) stops the run with one line instead of training on
    it: the weights stay finite and the last checkpoint stays good."""
    if not torch.isfinite(value):
        raise SystemExit(f"error: non-finite {what} at step {step}; lower --lr or check the reward")


# -------------------------------------- the clipped surrogate's dual clip, and the KL term


def dual_clip(pg_loss, advantages, c):
    """Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c): where A < 0 the per-token loss
    max(-ρA, -clip(ρ)A) is capped at -c·A, so one huge ratio on a bad sample cannot dominate
    the step. advantages: (B, 1) or broadcastable; c = 0 leaves the loss unchanged."""
    if not c:
        return pg_loss
    return torch.where(advantages < 0, torch.minimum(pg_loss, -c * advantages), pg_loss)


def kl_penalty(logp, ref_logp, kind="k3", limit=None, log_ratio_limit=None):
    """Per-token KL(π_θ‖π_ref) estimate with d = log π_ref − log π_θ (GRPO; Schulman 2020).

    k1 = −d (unbiased, can be negative); k2 = d²/2; k3 = e^d − d − 1 (≥ 0, unbiased under y ~ π_θ).
    limit: clamp the estimate to [−limit, limit]; log_ratio_limit: clamp d to that range first
    (verl's `low_var_kl`: d to ±20, so e^d stays finite, then k3 to ±10).
    """
    d = ref_logp - logp
    if log_ratio_limit is not None:
        d = d.clamp(-log_ratio_limit, log_ratio_limit)
    if kind == "k1":
        kl = -d
    elif kind == "k2":
        kl = 0.5 * d**2
    elif kind == "k3":
        kl = torch.exp(d) - d - 1
    else:
        raise ValueError(f"kind must be k1, k2 or k3, got {kind!r}")
    return kl if limit is None else kl.clamp(-limit, limit)


# ----------------------------------------------------------------------------- devices and seeds


def seed_everything(seed):
    """Seed python, numpy and torch (all devices); CPU runs are then bit-reproducible."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolved_precision(device, precision="auto"):
    """ "bf16" or "fp32": what `training_autocast` runs. "auto" is bf16 where the device multiplies
    bf16 natively — a GPU that supports it, a CPU with AVX512-BF16 or AMX (2.4–2.7× its fp32 matmul
    rate) — and fp32 elsewhere (a CPU without them multiplies bf16 far slower than fp32)."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, got {precision!r}")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    native = device.type == "cpu" and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    )
    return "bf16" if native else "fp32"


def training_autocast(device, precision="auto"):
    """The forward passes' precision: "bf16" = bf16 autocast on any device (a CPU too, so tests run
    the GPU's precision path); "auto" = bf16 where the device multiplies it natively
    (`resolved_precision`), else fp32; "fp32" = none. Weights stay fp32 (master weights); only the
    matmuls run in bf16."""
    import contextlib

    if resolved_precision(device, precision) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
