"""The cffi binding of libggml (ABI mode): hand-written declarations of the few functions
ggraph.check.ggml_ref calls besides op constructors (those come from the op records,
GGMLMap.cdecl), locating and loading the library, and checking it against them.

Declarations come from ggml.h / ggml-alloc.h / ggml-backend.h / ggml-cpu.h of ggml 0.25.3 (the
copy vendored by llama-cpp-python 0.3.36, ggml commit 0c1e570). Enum arguments are declared
`int` (C passes these enums as int); their values are never hard-coded: `load()` reads them
from the library, one probe tensor per op built by ggml's own constructor (the record's
GGMLMap.probe; `ggml_<op>(ctx, a[, a])` for element-wise ops), and checks them by
name (ggml_op_name, ggml_unary_op_name, ggml_glu_op_name; types by ggml_type_name, type size
and block size).

`struct ggml_tensor` is declared in full because ggml_ref reads `ne`, `nb`, `op`, `data`,
`view_src`, `view_offs` and, for graphs whose ops ggml's constructors would refuse (random
allocator DAGs), writes `op`, `src` and `nb`. `load()` verifies the layout before anything
else runs: sizeof against ggml_tensor_overhead(), then field round trips on probe tensors.

Where the library comes from: the directory in $GGRAPH_LIBGGML when set (nothing else is
tried then), else the `lib` directory of the installed `llama_cpp` package
(`pip install llama-cpp-python` builds ggml from source and ships libggml-base and libggml-cpu
there). Without either, `load()` raises GGMLUnavailable naming what it tried.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ggraph.ir.opkind import OpKind
from ggraph import config
from ggraph.ir.types import GGMLType

# sizeof(struct ggml_object) in ggml.c: size_t offs, size; ptr next; enum type; char pad[4]
GGML_OBJECT_SIZE = 32
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64

CDEFS = """
typedef struct ggml_context ggml_context;
struct ggml_cgraph;
struct ggml_backend;
struct ggml_backend_buffer;
struct ggml_backend_buffer_type;
struct ggml_gallocr;

struct ggml_init_params {
    size_t mem_size;
    void * mem_buffer;
    bool   no_alloc;
};

struct ggml_tensor {
    int type;
    struct ggml_backend_buffer * buffer;
    int64_t ne[4];
    size_t  nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct ggml_tensor * src[10];
    struct ggml_tensor * view_src;
    size_t view_offs;
    void * data;
    char name[64];
    void * extra;
    char padding[8];
};

/* library identity and enum names */
const char * ggml_version(void);
const char * ggml_commit(void);
const char * ggml_op_name(int op);
const char * ggml_type_name(int type);
const char * ggml_unary_op_name(int op);
const char * ggml_glu_op_name(int op);
const char * ggml_status_to_string(int status);
int64_t ggml_blck_size(int type);
size_t  ggml_type_size(int type);
int  ggml_get_unary_op(const struct ggml_tensor * tensor);
int  ggml_get_glu_op(const struct ggml_tensor * tensor);

/* contexts and tensors */
size_t ggml_tensor_overhead(void);
size_t ggml_graph_overhead_custom(size_t size, bool grads);
ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(ggml_context * ctx);
struct ggml_tensor * ggml_new_tensor_4d(ggml_context * ctx, int type,
        int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
size_t ggml_nbytes(const struct ggml_tensor * tensor);
const char * ggml_get_name(const struct ggml_tensor * tensor);
struct ggml_tensor * ggml_set_name(struct ggml_tensor * tensor, const char * name);
void ggml_set_input(struct ggml_tensor * tensor);
void ggml_set_output(struct ggml_tensor * tensor);

/* constructors ggml_ref and load() use themselves (views of raw-mode graphs, the layout
   check); every other op constructor is declared by its op record (GGMLMap.cdecl) */
struct ggml_tensor * ggml_view_4d(ggml_context * ctx, struct ggml_tensor * a,
        int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
        size_t nb1, size_t nb2, size_t nb3, size_t offset);
struct ggml_tensor * ggml_reshape_4d(ggml_context * ctx, struct ggml_tensor * a,
        int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_add(ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);

/* graphs */
struct ggml_cgraph * ggml_new_graph_custom(ggml_context * ctx, size_t size, bool grads);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
int  ggml_graph_n_nodes(struct ggml_cgraph * cgraph);
struct ggml_tensor * ggml_graph_node(struct ggml_cgraph * cgraph, int i);

/* backends and buffers */
struct ggml_backend_buffer_type * ggml_backend_cpu_buffer_type(void);
const char * ggml_backend_buft_name(struct ggml_backend_buffer_type * buft);
size_t ggml_backend_buft_get_alignment(struct ggml_backend_buffer_type * buft);
struct ggml_backend_buffer * ggml_backend_alloc_ctx_tensors_from_buft(ggml_context * ctx,
        struct ggml_backend_buffer_type * buft);
void   ggml_backend_buffer_free(struct ggml_backend_buffer * buffer);
void   ggml_backend_buffer_clear(struct ggml_backend_buffer * buffer, uint8_t value);
size_t ggml_backend_buffer_get_size(struct ggml_backend_buffer * buffer);
void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset,
        size_t size);
void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset,
        size_t size);
int  ggml_backend_graph_compute(struct ggml_backend * backend, struct ggml_cgraph * cgraph);
bool ggml_backend_supports_op(struct ggml_backend * backend, const struct ggml_tensor * op);
void ggml_backend_free(struct ggml_backend * backend);

/* the graph allocator */
struct ggml_gallocr * ggml_gallocr_new(struct ggml_backend_buffer_type * buft);
void   ggml_gallocr_free(struct ggml_gallocr * galloc);
bool   ggml_gallocr_reserve(struct ggml_gallocr * galloc, struct ggml_cgraph * graph);
size_t ggml_gallocr_get_buffer_size(struct ggml_gallocr * galloc, int buffer_id);
"""

# libggml-cpu.so
CPU_CDEFS = """
struct ggml_backend * ggml_backend_cpu_init(void);
void ggml_backend_cpu_set_n_threads(struct ggml_backend * backend_cpu, int n_threads);
"""


ENV_VAR = config.LIBGGML_VAR
INSTALL_HINT = ("install it with `pip install llama-cpp-python` (builds ggml from source, a few "
                "minutes), or point $GGRAPH_LIBGGML at a directory holding libggml-base and "
                "libggml-cpu")
_EXT = ".dylib" if sys.platform == "darwin" else ".so"

def ggml_cdecls() -> list[str]:
    """C declarations the op records add (constructors of ops newer than CDEFS), each once:
    records may share a constructor, and cffi refuses a function declared twice."""
    from ggraph.ops import REGISTRY

    return list(dict.fromkeys(d.ggml.cdecl for d in REGISTRY.values()
                              if d.ggml is not None and d.ggml.cdecl))


def ggml_ops() -> dict[OpKind, tuple[str, str | None]]:
    """ggraph op -> (ggml op name, unary/GLU sub-op name or None), from the op records."""
    from ggraph.ops import REGISTRY

    return {k: d.ggml_op for k, d in REGISTRY.items() if d.ggml_op is not None}


class GGMLUnavailable(RuntimeError):
    """libggml could not be found or loaded."""


# -- finding and loading the library --------------------------------------------------------

def find_libggml() -> Path:
    """The directory holding libggml-base and libggml-cpu (see the module doc)."""
    def missing(d: Path) -> list[str]:
        return [n + _EXT for n in ("libggml-base", "libggml-cpu") if not (d / (n + _EXT)).is_file()]

    env = config.libggml()
    if env:  # an explicit choice: no silent fall-back to another build
        lack = missing(Path(env))
        if not lack:
            return Path(env)
        raise GGMLUnavailable(f"${ENV_VAR}={env} holds no {', '.join(lack)}; point it at the "
                              f"directory of a libggml build or unset it to use "
                              f"llama-cpp-python's")
    tried = [f"${ENV_VAR} (not set)"]
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        tried.append("the llama_cpp package (not installed)")
    else:
        for loc in spec.submodule_search_locations:
            d = Path(loc) / "lib"
            lack = missing(d)
            if not lack:
                return d
            tried.append(f"the llama_cpp package: {d} (no {', '.join(lack)})")
    raise GGMLUnavailable("libggml not found; tried " + "; ".join(tried) + ". " + INSTALL_HINT)


@dataclass
class GGML:
    """The loaded library: cffi handles, enum values read from it, the CPU buffer type."""
    dir: Path
    ffi: Any
    base: Any
    cpu: Any
    version: str = ""
    commit: str = ""
    op: dict[OpKind, int] = field(default_factory=dict)      # ggraph op -> enum ggml_op
    sub: dict[OpKind, int] = field(default_factory=dict)     # unary / GLU sub-op values
    missing: dict[OpKind, str] = field(default_factory=dict)  # ops this build lacks: why
    op_names: list[str] = field(default_factory=list)       # ggml_op_name(i) up to GLU
    alignment: int = 0                                      # CPU buffer type alignment
    tensor_size: int = 0                                    # sizeof(struct ggml_tensor)

    def s(self, p: Any) -> str:
        return self.ffi.string(p).decode() if p != self.ffi.NULL else ""

    def describe(self) -> str:
        return (f"libggml {self.version} (commit {self.commit}) from {self.dir}, CPU buffer "
                f"alignment {self.alignment}")


_LIB: GGML | None = None


def load() -> GGML:
    """Load and check libggml once per process (GGMLUnavailable if absent or mismatched)."""
    global _LIB
    if _LIB is None:
        d = find_libggml()
        try:
            import cffi
        except ImportError:
            raise GGMLUnavailable("the cffi package is missing: pip install 'cffi>=1.16'") from None
        ffi = cffi.FFI()
        ffi.cdef(CDEFS)
        ffi.cdef(CPU_CDEFS)
        ffi.cdef("\n".join(ggml_cdecls()))
        try:
            base = ffi.dlopen(str(d / f"libggml-base{_EXT}"), ffi.RTLD_NOW | ffi.RTLD_GLOBAL)
            cpu = ffi.dlopen(str(d / f"libggml-cpu{_EXT}"), ffi.RTLD_NOW | ffi.RTLD_GLOBAL)
        except OSError as e:
            raise GGMLUnavailable(f"cannot load libggml from {d}: {e}. {INSTALL_HINT}") from None
        lib = GGML(d, ffi, base, cpu)
        lib.version, lib.commit = lib.s(base.ggml_version()), lib.s(base.ggml_commit())
        _check_layout(lib)
        _read_enums(lib)
        buft = base.ggml_backend_cpu_buffer_type()
        lib.alignment = int(base.ggml_backend_buft_get_alignment(buft))
        _LIB = lib
    return _LIB


def new_context(lib: GGML, n_tensors: int, no_alloc: bool, data_bytes: int = 0,
                graph_size: int = 0) -> Any:
    b = lib.base
    mem = (n_tensors + 4) * b.ggml_tensor_overhead() + data_bytes + 1024
    if graph_size:
        mem += b.ggml_graph_overhead_custom(graph_size, False)
    ctx = b.ggml_init({"mem_size": mem, "mem_buffer": lib.ffi.NULL, "no_alloc": no_alloc})
    if ctx == lib.ffi.NULL:
        raise MemoryError(f"ggml_init failed for a context of {mem} bytes")
    return ctx


def _check_layout(lib: GGML) -> None:
    """Fail loudly if ggml_cdefs' struct ggml_tensor does not match this build."""
    ffi, b = lib.ffi, lib.base
    lib.tensor_size = ffi.sizeof("struct ggml_tensor")
    if lib.tensor_size + GGML_OBJECT_SIZE != b.ggml_tensor_overhead():
        raise GGMLUnavailable(f"struct ggml_tensor of ggraph.check.ggml_cdefs is {lib.tensor_size} "
                              f"bytes but {lib.dir} reports a tensor overhead of "
                              f"{b.ggml_tensor_overhead()}: the library's ggml.h differs")
    ctx = new_context(lib, 4, no_alloc=False, data_bytes=4096)
    try:
        t = b.ggml_new_tensor_4d(ctx, int(GGMLType.F32), 2, 3, 5, 7)
        b.ggml_set_name(t, b"probe")
        v = b.ggml_view_4d(ctx, t, 2, 3, 2, 1, 8, 24, 48, 120)
        a = b.ggml_add(ctx, t, t)
        checks = {
            "type": t.type == 0, "ne": list(t.ne) == [2, 3, 5, 7],
            "nb": list(t.nb) == [4, 8, 24, 120], "nbytes": b.ggml_nbytes(t) == 840,
            "name": b.ggml_get_name(t) == t.name and lib.s(t.name) == "probe",
            "data": ffi.cast("char *", t.data) == ffi.cast("char *", t) + lib.tensor_size,
            "view_src": v.view_src == t and v.view_offs == 120,
            "view data": ffi.cast("char *", v.data) == ffi.cast("char *", t.data) + 120,
            "src": a.src[0] == t and a.src[1] == t and a.src[2] == ffi.NULL,
        }
    finally:
        b.ggml_free(ctx)
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise GGMLUnavailable(f"struct ggml_tensor of ggraph.check.ggml_cdefs does not match "
                              f"{lib.dir} (fields {', '.join(bad)} differ): the library's ggml.h differs")


def _read_enums(lib: GGML) -> None:
    """Type facts checked by name and size; every op record's enum values probed."""
    b = lib.base
    for t in GGMLType:
        name = b.ggml_type_name(int(t))
        if (lib.s(name) != str(t) or b.ggml_type_size(int(t)) != t.type_size
                or b.ggml_blck_size(int(t)) != t.block_size):
            raise GGMLUnavailable(f"{lib.dir}: ggml type {int(t)} is {lib.s(name)!r} "
                                  f"({b.ggml_type_size(int(t))} bytes per "
                                  f"{b.ggml_blck_size(int(t))}), ggraph expects {t}")
    from ggraph.ops import REGISTRY

    for kind in REGISTRY:
        ensure_op(lib, kind)


@dataclass
class Probe:
    """What a record's GGMLMap.probe gets (ggraph.ops.registry.GGMLProbe): libggml's
    functions, a no-alloc context, NULL, an F32 tensor `a` [64, 4, 2, 1], and `new`."""
    lib: Any
    ctx: Any
    null: Any
    a: Any = None

    def new(self, type: GGMLType, *ne: int) -> Any:
        ne4 = (tuple(ne) + (1, 1, 1, 1))[:4]
        return self.lib.ggml_new_tensor_4d(self.ctx, int(type), *ne4)


def _default_probe(kind: OpKind, elementwise: str | None) -> Callable[[Probe], Any] | None:
    """`ggml_<op>(ctx, a[, a])` for an element-wise op (unary: one source, binary: two);
    any other op must say how its constructor is called (GGMLMap.probe)."""
    if elementwise is None:
        return None
    n = 2 if elementwise == "binary" else 1
    return lambda k: getattr(k.lib, f"ggml_{kind.value}")(k.ctx, *([k.a] * n))


def ensure_op(lib: GGML, kind: OpKind) -> None:
    """Read kind's ggml enum value (and unary/GLU sub-op) from a tensor built by the probe in
    its op record, and check it by ggml's names; once per kind (records registered after
    load() are probed on first use). A constructor this build lacks goes to lib.missing."""
    if kind in lib.op or kind in lib.missing:
        return
    from ggraph.ops import REGISTRY

    rec = REGISTRY.get(kind)
    if rec is None or rec.ggml_op is None:
        return  # no record or no ggml counterpart: ggml_ref says "ggml has no op for it"
    assert rec.ggml is not None
    want, sub = rec.ggml_op
    probe = rec.ggml.probe or _default_probe(kind, rec.elementwise)
    if probe is None:
        lib.missing[kind] = (f"the record of {kind} maps it to ggml's {want} but gives no "
                             f"GGMLMap.probe to read its enum value")
        return
    b, ffi = lib.base, lib.ffi
    ctx = new_context(lib, 16, no_alloc=True)
    try:
        k = Probe(b, ctx, ffi.NULL)
        k.a = k.new(GGMLType.F32, 64, 4, 2, 1)
        try:
            t = probe(k)
        except AttributeError as e:  # the function is not exported by this build
            lib.missing[kind] = f"this libggml lacks ggml's constructor for {kind} ({e})"
            return
        value = int(t.op)
        got = lib.s(b.ggml_op_name(value))
        sub_value = None
        if want == "UNARY":
            sub_value = int(b.ggml_get_unary_op(t))
            got += "/" + lib.s(b.ggml_unary_op_name(sub_value))
        elif want == "GLU":
            sub_value = int(b.ggml_get_glu_op(t))
            got += "/" + lib.s(b.ggml_glu_op_name(sub_value))
        expect = want + (f"/{sub}" if sub_value is not None else "")
    finally:
        b.ggml_free(ctx)
    if got != expect:
        raise GGMLUnavailable(f"{lib.dir}: ggml's constructor for {kind} built op {got}, "
                              f"expected {expect}")
    lib.op[kind] = value
    if sub_value is not None:
        lib.sub[kind] = sub_value
    while len(lib.op_names) <= value:  # names of ggml's ops up to the highest one seen
        lib.op_names.append(lib.s(b.ggml_op_name(len(lib.op_names))))
