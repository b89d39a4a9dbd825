"""
What --router can name: the registry of cross-layer methods, and the forms its flag takes; and what
a method promises (lime.Router's contract), checked as the model is built.

A method is a lime.Router (how attention reads the K/V of earlier layers) or a lime.Residual (the
stream between the sub-layers). A subclass of Method that states a `name` joins ROUTERS as it is defined,
so a method is a --router value once its module is imported; nothing else lists them.

NOTE a footgun: a module is imported only when something asks for it, so ROUTERS alone may lack
methods. Read the methods through registry(), which first imports every module of MODULES: a fork
that writes its method in a new file adds the file's module name there.
"""

import copy
import difflib
import importlib
import inspect
import re
from contextlib import contextmanager

import torch
import torch.nn as nn

from cli import SIZE

ROUTERS = {}  # --router name -> class, in the order they are defined (read it through registry())
MODULES = ("lime", "ablations", "baselines")  # where the methods are defined


def registry():
    """A copy of ROUTERS once every module of MODULES is imported. Ordered by module as in MODULES, then
    methods defined in a test (or __main__); within a module, as it defines them. So the order does not depend
    on which module was imported first (baselines.py imports lime.py, but not ablations.py)."""
    for module in MODULES:
        try:
            importlib.import_module(module)  # (no-op once imported; a module still importing is left to finish)
        except ModuleNotFoundError as e:
            if e.name is None or not f"{module}.".startswith(f"{e.name}."):  # (forks.mine: forks, or forks.mine)
                raise  # (one that the module itself imports: its own traceback says which)
            raise ModuleNotFoundError(f"methods.MODULES names {module!r}, but Python finds no module of that name "
                                      f"(a {module.replace('.', '/')}.py beside methods.py)", name=module) from None
    rank = {module: i for i, module in enumerate(MODULES)}
    for cls in ROUTERS.values():  # NOTE a fork's module that its test imports: else its method would be a --router
        # value in that test alone, and in the tests of every method or not, by the order pytest imports them
        module, last = cls.__module__, cls.__module__.rsplit(".", 1)[-1]
        # (a test's module, as pytest finds them, or a session's own: a spawned process sees its __main__ so)
        if module not in rank and module not in ("__main__", "__mp_main__") and last != "conftest" and \
                not last.startswith("test_") and not last.endswith("_test"):
            raise TypeError(f"{module}.{cls.__qualname__} is a method, but methods.MODULES lacks {module!r}: add it "
                            f"there, or no script knows --router={cls.name.removesuffix('-J')}")
    return dict(sorted(ROUTERS.items(), key=lambda item: rank.get(item[1].__module__, len(MODULES))))  # (stable)


class Method(nn.Module):
    """A cross-layer method. A subclass that states a `name` of its own adds itself to ROUTERS; one that
    only inherits a name does not (so a base class for a fork's methods is no --router value).
    A name ending in "-J" takes a positive integer, with `J` its default if any ('last-4'; 'hc' is 'hc-4').
    A name already taken by another class is an error: else the class defined last would silently
    replace the other everywhere."""
    name, J = None, None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            # NOTE a name --router could not select, or that another's bare form already selects ('hc' is hc-J's):
            # an error here, not a name listed in every --help that no command reaches, nor one that silently
            # takes over another method's command line
            stem = cls.name.removesuffix("-J")
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", stem) or re.search(r"-[0-9]+$", stem):
                raise TypeError(f"{cls.__qualname__}.name = {cls.name!r}: a --router name is letters, digits, '_', "
                                "'.', '+' and '-' (no ',', '/' or space), not ending in '-<digits>'")
            takes_j = cls.name.endswith("-J")
            J = cls.__dict__.get("J")  # a default J, as --router=name-J would give it (None: no default)
            if J is not None and not (isinstance(J, int) and not isinstance(J, bool) and 0 < J < 2**31):
                raise TypeError(f"{cls.__qualname__}.J = {J!r}: a default J is a whole number from 1, or None")
            other = stem if takes_j else f"{cls.name}-J"
            # (a default J clashes only on a name that takes one: a plain name's inherited J is never read)
            clash = ROUTERS.get(other) if (takes_j and cls.J) or getattr(ROUTERS.get(other), "J", None) else None
            if clash is not None and (clash.__module__, clash.__qualname__) != (cls.__module__, cls.__qualname__):
                raise TypeError(f"--router={stem} would name both {clash.__module__}.{clash.__qualname__} and "
                                f"{cls.__module__}.{cls.__qualname__}; rename one")
            held = ROUTERS.get(cls.name)
            where = (cls.__module__, cls.__qualname__)
            if held is not None and (held.__module__, held.__qualname__) != where:  # (a module imported again: same)
                raise TypeError(f"two methods are named {cls.name!r}: {held.__module__}.{held.__qualname__} and "
                                f"{'.'.join(where)}; rename one")
            ROUTERS[cls.name] = cls

    @classmethod
    def probe(cls):
        """An instance to read a router's capabilities from (satisfies): layer 2 of a tiny model with 2 kv heads;
        J is what --router would give it: its default, else 2; None for a name without -J. None for a method of
        the stream. A router that cannot be built so is an error naming it; such a router defines its own probe()."""
        from lime import GPTConfig, Router  # (here, not at the top: lime.py imports this module)
        if not issubclass(cls, Router):
            return None
        tiny = GPTConfig(block_size=1, vocab_size=1, n_layer=3, n_head=2, n_kv_head=2, n_embd=4, mlp_hidden=1,
                         router="none")
        J = (cls.J or 2) if (cls.name or "").endswith("-J") else None
        where = f"{cls.__module__}.{cls.__qualname__}"
        try:
            inspect.signature(cls).bind(tiny, 2, J)
        except TypeError as e:  # (else the error below would ask for a probe(), where the signature is what is wrong)
            raise TypeError(f"{where}.__init__ cannot take (config, layer, J), which every router is built with "
                            f"({e})") from None
        try:
            return cls(tiny, 2, J)
        except Exception as e:  # (chained: the traceback still shows where it refused)
            raise TypeError(f"{where} cannot be built at layer 2 with 2 kv heads and J={J} "
                            f"({type(e).__name__}: {e}): give it a probe(), a classmethod that returns an instance to "
                            f"read its capabilities from (methods.Method.probe)") from e


def parse_router(spec):
    """'first-4' -> (First, 4); 'lime' -> (LIMe, None); 'hc' -> (its class, its default J). Anything
    else is a ValueError naming the forms."""
    m = re.fullmatch(r"(.*?)(?:-([1-9][0-9]*))?", str(spec))
    name, J = (f"{m[1]}-J", int(m[2])) if m[2] else (m[1], None)
    known = registry()
    if name not in known and getattr(known.get(f"{name}-J"), "J", None):  # the J it takes by default
        name, J = f"{name}-J", known[f"{name}-J"].J
    if name not in known or name.endswith("-J") != (J is not None):
        forms = router_forms()
        stem = str(spec).rsplit("-", 1)[0]  # 'lime' of 'lime-4', 'last' of 'last-0' and of 'last'
        stems = {n.removesuffix("-J").lower(): n for n in known}  # (a name that differs in case or a letter)
        near = [stems[s] for s in difflib.get_close_matches(m[1].lower(), stems, n=1)]  # (the name, its J aside)
        if near:  # as a --router value: with the J given, else the default J's bare name, else an example J
            near = [near[0].replace("-J", f"-{m[2]}" if m[2] else "" if known[near[0]].J else "-4")]
        why = (f"{stem} takes no -J" if stem in known and stem != spec else f"e.g. {stem}-4"
               if f"{stem}-J" in known else f"did you mean {near[0]}?" if near else "a method of your own joins them "
               "once its module is in methods.MODULES and its class states a name of its own (name = ...)")
        raise ValueError(f"unknown router {spec!r}: expected {forms}" + " (J a positive integer)" * ("-J" in forms)
                         + f"; {why}")
    if J is not None and not SIZE[1](J):  # (a size torch cannot hold: an OverflowError deep in torch)
        raise ValueError(f"router {spec!r}: J must be {SIZE[0]}, got {J}")
    return known[name], J


def distinct(names):
    """Each method of `names` once, in their order, by what it selects ('hc' and 'hc-4' are one); a ValueError for
    a name parse_router refuses."""
    kept = {}
    for name in names:
        kept.setdefault(parse_router(name), name)
    return list(kept.values())


def check_router(router, n_embd, J=None):
    """What lime.Router asks of a router built with J, checked as the model is built (lime.make_router), else a
    ValueError naming the class: its sources, distinct layers up to its own, ascending, itself last; weights() shaped
    for that many sources, and a per-token router's weights(x) too, for each token. A source column too many would
    train, unread (the routing takes each source's own column); one too few would fail deep in the routing."""
    layer, sources, n_kv, cls = router.layer, router.sources, router.n_kv, type(router).__qualname__
    if sources != sorted(set(sources)) or sources[-1:] != [layer] or sources[0] < 0:
        raise ValueError(f"{cls}.source_layers({layer}, {J}) gave {sources}: it must list distinct layers of "
                         f"0..{layer}, ascending, the layer itself last")
    n = len(sources)
    try:
        w = router.weights()
    except AttributeError as e:  # (lime.Router's weights() returns self.weight)
        raise ValueError(f"{cls}.weights() failed ({e}): a router sets self.weight (a Parameter, or a buffer) in its "
                         "__init__, or defines weights()") from e
    shapes = {"weights()": (w, [(n_kv, n, n_kv), (n_kv, n)])}
    if router.per_token:  # and for an input x (B, T, C): of 2 x 3 tokens, so that one per sequence does not fit
        shapes["weights(x)"] = (router.weights(torch.zeros(2, 3, n_embd)), [(2, 3, n_kv, n)])
    for call, (w, fits) in shapes.items():
        if tuple(w.shape) not in fits:
            raise ValueError(f"{cls}.{call} is {tuple(w.shape)} at layer {layer}: for {n} source layer(s) and {n_kv} "
                             f"kv heads, it must be {' or '.join(map(str, fits))}")


def check_residual(residual, config):
    """What lime.Residual asks of a method of the stream, checked as the model is built (a forward of 2 x 3 zeros
    through a copy of the stream alone, in eval mode, without grad), else a ValueError naming the class: each
    sub-layer's f reads (B, T, n_embd) of add(i, h, f), and end(h) gives the final norm the same. The stream between
    them is the method's own (Hyper-Connections' holds n streams)."""
    want = (2, min(3, config.block_size), config.n_embd)  # (not 1 where it can be: broadcasting would hide a slip)

    def given(what, x):
        if tuple(x.shape) != want:
            raise ValueError(f"{type(residual).__qualname__}.{what} {tuple(x.shape)} for a batch of 2 x {want[1]} "
                             f"tokens: it must be {want}, (B, T, n_embd)")
        return torch.zeros_like(x)  # (what a sub-layer gives back)

    stream = copy.deepcopy(residual).eval()  # (the model's own keeps its modes, and what a method counts or holds)
    with torch.no_grad():
        h = stream.start(torch.zeros(want))
        for i in range(2 * config.n_layer):
            h = stream.add(i, h, lambda x: given(f"add({i}, h, f) gives f", x))
        given("end(h) is", stream.end(h))


def check_registered(methods, model):
    """A ValueError naming a method's parameter that torch does not see, being in a plain list, tuple or dict (not an
    nn.ParameterList, nn.ModuleList, ...) or a tensor that requires grad but is no nn.Parameter: nothing would train,
    save or count it, silently. What is held there and is the model's elsewhere (a list of its blocks) is no error."""
    seen, torch_own = {id(p) for p in model.parameters()}, set(vars(nn.Module()))  # (_parameters, _modules, ...)
    for m in methods:
        for path, module in m.named_modules():
            for attr, value in vars(module).items():
                if attr in torch_own:
                    continue
                items = value.values() if isinstance(value, dict) else \
                    value if isinstance(value, (list, tuple)) else [value]  # (a bare tensor: itself)
                tensors = [t for item in items for t in (item.parameters() if isinstance(item, nn.Module) else [item])
                           if torch.is_tensor(t)]
                if any(t.requires_grad and id(t) not in seen for t in tensors):
                    raise ValueError(f"{type(m).__name__}.{f'{path}.{attr}'.lstrip('.')} holds a parameter that torch "
                                     f"does not see, in a {type(value).__name__}: it would not train, nor be saved or "
                                     "counted; hold it in an nn.ParameterList or nn.ParameterDict (a module in an "
                                     "nn.ModuleList or nn.ModuleDict)")


TORCH_INIT = ("reset_parameters", "_reset_parameters")  # how torch's layers set their own (nn.MultiheadAttention's)


@contextmanager
def require_initialised(methods):
    """Around the body of GPT.init_weights (under torch.no_grad): the methods' bare parameters, their own or in a
    container such as nn.ParameterList (not those of torch's layers, nn.Linear and the like, which have an initial
    value of their own), are NaN until something sets them, and one that nothing set is then a ValueError asking
    its class for an init_weights(). Else a fork's parameter would train from whatever torch.empty left in memory."""
    own = [(type(m).__name__, f"{path}.{name}".lstrip("."), p) for m in methods for path, module in m.named_modules()
           if not any(hasattr(module, f) for f in TORCH_INIT) for name, p in module.named_parameters(recurse=False)]
    for _, _, p in own:
        p.fill_(float("nan"))
    yield
    for method, name, p in own:
        if not p.is_meta and p.isnan().any():  # e.g. a router whose weights() is not the Parameter itself
            raise ValueError(f"nothing gives {method}.{name} an initial value: define {method}.init_weights() (a value "
                             "given in __init__ is not kept: the model's init_weights sets every weight anew)")


def router_forms(where=None):
    """The --router forms, 'none, lime, ..., dwa or value-residual'; with `where`, only the routers that
    satisfy it: router_forms(pruning.prunable). A default J is optional: 'hc[-J]'."""
    names = [name.replace("-J", "[-J]") if cls.J else name for name, cls in registry().items()
             if where is None or satisfies(cls, where)]
    return " or ".join(filter(None, [", ".join(names[:-1]), *names[-1:]]))  # ("" where none satisfies it)


def satisfies(cls, test):
    """Whether the method `cls` is a router whose instance satisfies test: satisfies(cls, pruning.prunable)."""
    router = cls.probe()
    return router is not None and test(router)
