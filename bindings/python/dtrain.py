"""dtrain for Python: a ctypes binding over libdtrain.so.

    import dtrain
    ctx = dtrain.Context(seed=1)
    w = ctx.param("fc.weight", (10, 784)); dtrain.init_kaiming_uniform(w, 5 ** 0.5)
    b = ctx.param("fc.bias", (10,));        dtrain.init_bias(b, 784)
    opt = dtrain.Optimizer(ctx, "adam", lr=1e-3)
    loss = dtrain.cross_entropy(dtrain.linear(x, w, b), y)
    ctx.backward(loss); opt.step(); opt.zero_grad(); ctx.step_reset()

One module, no compiled part: it finds the shared library through
DTRAIN_LIB, then ../../build/libdtrain.so next to this file, then the one
`pip install ./bindings/python` put beside it (dtrain_native/), then the
system's libdtrain.so.0 (./build.sh install).  The C API is in dtrain.h;
this module follows it name for name (dt_linear -> dtrain.linear).

Errors: every C failure raises a dtrain.Error subclass (InvalidArgument is
also a ValueError, Timeout a TimeoutError, PeerError a ConnectionError, ...)
whose message is the C library's own (dt_last_error).

Lifetimes, as in C:
  - tensors made by ops are step tensors: dt_ctx_step_reset (ctx.step_reset())
    frees them.  Using one afterwards raises BadState instead of reading
    freed memory; so does a loader batch after the loader's next batch.
  - parameters live as long as the context; Context.tensor / from_numpy
    tensors until freed (or garbage-collected).
  - Tensor.numpy() of a parameter, Context.tensor or from_numpy tensor is a
    view of its memory (no copy) on the CPU backend, and the view keeps that
    memory alive: past free(), past Context.close() (the C context is freed
    when the last view goes).  Of anything else (a step tensor, a loader
    batch, a gradient, optimizer state, or on a device backend) it is a
    copy, because that memory is reused or moved.  Python cannot read freed
    memory through an array from this module.
  - from_numpy(array) wraps the array's memory (no copy) when it is
    C-contiguous, aligned and of a dtrain dtype (float32, int32, uint8),
    else copies; the tensor keeps the array alive.
  - Context.close() (or the with-block's end) frees everything made from it.
"""

import ctypes
import ctypes.util
import faulthandler
import functools
import math
import operator
import os
import signal
import threading
import weakref
from collections import namedtuple

import numpy as np
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = [
    "Error", "InvalidArgument", "OutOfMemory", "FileError", "CorruptFile", "Mismatch",
    "NotSupported", "BadState", "Timeout", "PeerError", "Preempted", "EXIT_PREEMPTED",
    "Context", "Tensor", "Optimizer", "ParamGroup", "Dataset", "Loader", "Comm", "DDP", "Metrics",
    "DistEnv", "evaluate", "count_correct", "checkpoint_save", "checkpoint_load", "now",
    "library_path", "version", "version_string", "dtype_name", "dtype_size", "custom_op",
    "recompute", "LossScaler", "checkpoint_latest",
    "checkpoint_metadata", "checkpoint_consolidate", "checkpoint_arrays", "CheckpointReport", "Store", "Work", "spawn", "launch", "Replicas",
    "hogwild", "HogwildStats", "ParameterServer", "predict", "Monitor", "profile_rank_stats", "dtrun_main",
    "profiling", "profile_straggler", "schedule_lr", "strerror",
    # ops (each records its backward) and initialisers
    "reshape", "flatten", "transpose", "permute", "slice", "contiguous", "concat", "matmul",
    "linear", "add", "sub", "mul", "div", "scale", "pow", "where", "masked_fill", "sum", "mean",
    "exp", "log", "sqrt", "relu", "gelu", "gelu_tanh", "tanh", "sigmoid", "softmax",
    "log_softmax", "attention", "cross_entropy", "cross_entropy_ignore", "mse", "conv2d",
    "max_pool2d", "avg_pool2d", "embedding", "layer_norm", "dropout",
    "init_uniform", "init_normal", "init_kaiming_uniform", "init_kaiming_normal",
    "init_xavier_uniform", "init_xavier_normal", "init_bias",
    # process groups, pipelines, tensor parallelism, the profiler
    "dist_env", "Group", "Pipe", "layer_times", "pipe_partition", "tp_copy", "tp_reduce",
    "tp_gather", "tp_split", "tp_linear_col", "tp_linear_row", "tp_shard", "profile_start",
    "profile_stats", "profile_finish",
]

# --- 1. the library -----------------------------------------------------------------------

_HERE = os.path.dirname(os.path.abspath(__file__))


def _find_library():
    env = os.environ.get("DTRAIN_LIB")
    if env:
        return env
    local = os.path.join(_HERE, "..", "..", "build", "libdtrain.so")
    if os.path.exists(local):
        return os.path.normpath(local)
    shipped = os.path.join(_HERE, "dtrain_native", "libdtrain.so")   # pip install
    if os.path.exists(shipped):
        return shipped
    return ctypes.util.find_library("dtrain") or "libdtrain.so.0"


def _restore_python_signal_handlers():
    """Loading libdtrain loads libfabric and, on Debian, libinfinipath, whose
    constructor takes SIGINT, SIGTERM, SIGSEGV and others for itself; dtrain's
    fabric backend puts the default actions back (backends/fabric.c).  Python's
    own handlers come back here, so that Ctrl-C still raises KeyboardInterrupt
    and faulthandler still reports crashes."""
    if threading.current_thread() is not threading.main_thread():
        return   # only the main thread may set handlers; Python's stay lost
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGSEGV, signal.SIGBUS,
                signal.SIGILL, signal.SIGABRT):
        handler = signal.getsignal(sig)
        if callable(handler):
            signal.signal(sig, handler)
    if faulthandler.is_enabled():
        faulthandler.enable()


library_path = _find_library()
_lib = ctypes.CDLL(library_path)
_restore_python_signal_handlers()

_P, _I, _I64, _U64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
_F, _D, _S, _SZ = ctypes.c_float, ctypes.c_double, ctypes.c_char_p, ctypes.c_size_t
_I64P = ctypes.POINTER(ctypes.c_int64)
_FP = ctypes.POINTER(ctypes.c_float)


def _fn(name, restype, *argtypes):
    f = getattr(_lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


# --- 2. the C structs (bindings/python/tests checks their layout against C's) -------------

class dt_ctx_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("backend", _S), ("threads", _I), ("seed", _U64),
                ("malloc_fn", _P), ("realloc_fn", _P), ("free_fn", _P), ("alloc_user", _P),
                ("arena_bytes", _SZ), ("device", _I), ("custom_backend", _P),
                ("arena_max_bytes", _SZ)]


class dt_mem_stats(ctypes.Structure):
    _fields_ = [("arena_capacity", _SZ), ("arena_used", _SZ), ("arena_peak", _SZ),
                ("persistent_bytes", _SZ), ("arena_grows", _U64)]


class dt_optim_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("kind", _I), ("lr", _F), ("momentum", _F), ("dampening", _F),
                ("nesterov", _I), ("weight_decay", _F), ("beta1", _F), ("beta2", _F),
                ("eps", _F), ("param_dtype", _I), ("state_dtype", _I)]


class dt_param_group(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("params", ctypes.POINTER(_P)), ("n", _I),
                ("lr", _F), ("momentum", _F), ("dampening", _F), ("weight_decay", _F),
                ("beta1", _F), ("beta2", _F), ("eps", _F), ("nesterov", _I)]


class dt_schedule(ctypes.Structure):
    _fields_ = [("kind", _I), ("step_size", _I64), ("gamma", _F), ("warmup_steps", _I64),
                ("total_steps", _I64), ("min_lr", _F)]


class dt_loader_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("batch", _I), ("shuffle", _I), ("drop_last", _I), ("seed", _U64),
                ("mean", _F), ("std", _F), ("prefetch", _I), ("shard_rank", _I),
                ("shard_count", _I), ("shard_no_pad", _I), ("global_batches", _I)]


class dt_sample_field(ctypes.Structure):
    _fields_ = [("dtype", _I), ("ndim", _I), ("shape", _I64 * 5)]


class dt_token_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("context", _I64), ("stride", _I64), ("samples", _I64), ("seed", _U64),
                ("first", _I64), ("count", _I64)]


class dt_csv_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("delimiter", ctypes.c_char), ("header", _I), ("target_name", _S),
                ("target_column", _I), ("classify", _I)]


class dt_dist_env(ctypes.Structure):
    _fields_ = [("rank", _I), ("world_size", _I), ("local_rank", _I),
                ("local_world_size", _I), ("master_addr", ctypes.c_char * 256),
                ("master_port", _I), ("launcher", _S)]


class dt_store_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("token", _S), ("bind_addr", _S), ("timeout_ms", _I)]


class dt_comm_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("transport", _S), ("host", _S), ("timeout_ms", _I), ("intra_host", _S),
                ("host_id", _S), ("store", dt_store_config), ("collective_timeout_ms", _I)]


class dt_ddp_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("bucket_bytes", _SZ), ("overlap", _I), ("broadcast_params", _I),
                ("compress", _I), ("topk_ratio", _F), ("topk_warmup_steps", _I),
                ("error_feedback", _I), ("ps", _P), ("zero", _I)]


class dt_ddp_stats(ctypes.Structure):
    _fields_ = [("steps", _I64), ("buckets", _I), ("bucket_bytes", _SZ),
                ("backward_s", _D), ("comm_s", _D), ("exposed_s", _D),
                ("grad_bytes", _U64), ("payload_bytes", _U64), ("bytes_sent", _U64),
                ("block_launches", _I64), ("overlap", _I),
                ("zero", _I), ("shard_floats", _I64), ("grad_bytes_peak", _SZ),
                ("gather_s", _D), ("gather_exposed_s", _D), ("gathers", _I64),
                ("gathers_on_demand", _I64)]


class dt_eval_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("batch", _I), ("mean", _F), ("std", _F), ("metric", _I), ("metric_fn", _P),
                ("metric_user", _P)]


class dt_metrics(ctypes.Structure):
    _fields_ = [("samples", _I64), ("correct", _I64), ("accuracy", _D), ("loss", _D),
                ("value", _D)]


class dt_profile_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("max_events", _I), ("straggler_threshold", _D), ("check_every", _I)]


class dt_profile_stats(ctypes.Structure):
    _fields_ = [("rank", _I), ("steps", _I64), ("step_s", _D), ("data_s", _D),
                ("forward_s", _D), ("backward_s", _D), ("comm_wait_s", _D),
                ("optimizer_s", _D), ("idle_s", _D), ("comm_s", _D), ("collectives", _I64),
                ("coll_bytes", _U64), ("busbw", _D), ("ps_calls", _I64),
                ("ps_latency_s", _D), ("ps_max_staleness", _I64), ("ps_mean_staleness", _D),
                ("samples", _I64), ("events", _I64), ("dropped", _I64),
                ("straggler_warnings", _I), ("pipe_wait_s", _D), ("pipe_bubble_ideal", _D),
                ("ps_serve_s", _D), ("ps_busy_s", _D), ("ps_stalled_s", _D), ("ps_served", _I64),
                ("ps_bytes_in", _D), ("ps_bytes_out", _D), ("ps_queue_max", _I64),
                ("ps_keys", _I64), ("gather_s", _D), ("gather_exposed_s", _D),
                ("gathers", _I64), ("gathers_on_demand", _I64), ("wall_s", _D), ("cpu_s", _D),
                ("cpu_wait_s", _D), ("throttled_s", _D), ("cpu_periods", _I64),
                ("cpu_throttled_periods", _I64), ("longest_wait_s", _D), ("longest_wait_rank", _I),
                ("ps_slowest_server", _I), ("ps_slowest_server_ms", _D),
                ("ps_server_median_ms", _D), ("eval_s", _D), ("ckpt_s", _D),
                ("threads", _I)]


_STRUCTS = [dt_ctx_config, dt_mem_stats, dt_optim_config, dt_param_group, dt_schedule, dt_loader_config,
            dt_dist_env, dt_store_config, dt_comm_config, dt_ddp_config, dt_ddp_stats,
            dt_eval_config, dt_metrics, dt_profile_config, dt_profile_stats]

class dt_pipe_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("micro_batches", _I), ("schedule", _I)]


class dt_pipe_stats(ctypes.Structure):
    _fields_ = [("steps", _I64), ("micro_batches", _I64), ("step_s", _D), ("compute_s", _D),
                ("wait_s", _D), ("bubble", _D), ("bubble_ideal", _D), ("bytes_sent", _U64),
                ("in_flight_peak", _I), ("act_bytes_peak", _SZ)]


_STRUCTS += [dt_pipe_config, dt_pipe_stats, dt_sample_field, dt_token_config, dt_csv_config]


class dt_checkpoint_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("dtype", _I), ("n_meta", _I), ("meta_keys", ctypes.POINTER(_S)),
                ("meta_values", ctypes.POINTER(_S)), ("strict", _I)]


class dt_checkpoint_report(ctypes.Structure):
    _fields_ = [("loaded", _I), ("missing", _I), ("unexpected", _I), ("mismatched", _I),
                ("names", ctypes.c_char * 512)]


class dt_loss_scale_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("init_scale", _F), ("growth_factor", _F), ("backoff_factor", _F),
                ("growth_interval", _I)]


class dt_spawn_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("nranks", _I), ("transport", _S), ("grace_ms", _I), ("max_restarts", _I),
                ("min_ranks", _I), ("prefix_output", _I), ("bind_cpus", _I)]


class dt_dp_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("replicas", _I), ("replica", dt_ctx_config), ("optim", dt_optim_config)]


class dt_hogwild_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("threads", _I), ("steps", _I64), ("lr", _F), ("thread", dt_ctx_config)]


class dt_hogwild_stats(ctypes.Structure):
    _fields_ = [("steps", _I64), ("mean_loss", _D), ("rows_updated", _I64),
                ("dense_updates", _I64)]


class dt_ps_table(ctypes.Structure):
    _fields_ = [("name", _S), ("rows", _I64), ("dim", _I64), ("init_scale", _F),
                ("seed", _U64)]


class dt_ps_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("servers", _I), ("mode", _I), ("staleness", _I), ("optim", dt_optim_config),
                ("schedule", dt_schedule), ("tables", ctypes.POINTER(dt_ps_table)),
                ("ntables", _I), ("replicate", _I), ("checkpoint_dir", _S),
                ("checkpoint_every", _I), ("rejoin_ms", _I), ("chunk_bytes", _SZ),
                ("prefetch", _I)]


class dt_ps_stats(ctypes.Structure):
    _fields_ = [("pushes", _I64), ("pulls", _I64), ("steps", _I64), ("max_staleness", _I64),
                ("mean_staleness", _D), ("wait_s", _D), ("dropped_workers", _I),
                ("rows_pushed", _I64), ("rows_pulled", _I64), ("rows_updated", _I64),
                ("checkpoints", _I64), ("resumed", _I), ("resumed_step", _I64),
                ("rejoined", _I), ("rejoins", _I)]


class dt_monitor_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ),
                ("listen", _S), ("interval_s", _D), ("token", _S)]


class dt_preempt_config(ctypes.Structure):
    _fields_ = [("struct_size", _SZ), ("signals", ctypes.c_uint)]


_STRUCTS += [dt_preempt_config]
_STRUCTS += [dt_checkpoint_config, dt_checkpoint_report, dt_loss_scale_config, dt_spawn_config,
             dt_dp_config, dt_hogwild_config, dt_hogwild_stats, dt_ps_table, dt_ps_config,
             dt_ps_stats, dt_monitor_config]

_FORWARD_FN = ctypes.CFUNCTYPE(_P, _P, _P, _P)   # dt_tensor *(*)(dt_ctx *, dt_tensor *, void *)
_STAGE_FN = ctypes.CFUNCTYPE(_P, _P, _P, _P, _P)   # (ctx, x, y, user) -> dt_tensor *
_LOG_FN = ctypes.CFUNCTYPE(None, _P, _S)

# --- 3. the functions ---------------------------------------------------------------------

_C = type("C", (), {})()   # a namespace of the declared C functions
for _name, _res, _args in [
    ("dt_strerror", _S, [_I]),
    ("dt_ctx_config_init", None, [ctypes.POINTER(dt_ctx_config)]),
    ("dt_ctx_new", _P, [ctypes.POINTER(dt_ctx_config)]),
    ("dt_ctx_free", None, [_P]),
    ("dt_ctx_status", _I, [_P]),
    ("dt_last_error", _S, [_P]),
    ("dt_last_status", _I, [_P]),
    ("dt_clear_error", None, [_P]),
    ("dt_ctx_set_log", None, [_P, _LOG_FN, _P]),
    ("dt_last_warning", _S, [_P]),
    ("dt_backend_name", _S, [_P]),
    ("dt_ctx_threads", _I, [_P]),
    ("dt_ctx_set_grad_enabled", None, [_P, _I]),
    ("dt_ctx_grad_enabled", _I, [_P]),
    ("dt_ctx_set_training", None, [_P, _I]),
    ("dt_ctx_training", _I, [_P]),
    ("dt_mem_stats_get", None, [_P, ctypes.POINTER(dt_mem_stats)]),
    ("dt_ctx_step_reset", None, [_P]),
    ("dt_ctx_seed", None, [_P, _U64]),
    # tensors
    ("dt_tensor_new", _P, [_P, _I, _I, _I64P]),
    ("dt_tensor_wrap", _P, [_P, _I, _I, _I64P, _P]),
    ("dt_tensor_free", None, [_P]),
    ("dt_tensor_set", _I, [_P, _P, _I64]),
    ("dt_tensor_get", _I, [_P, _P, _I64]),
    ("dt_tensor_fill", _I, [_P, _F]),
    ("dt_tensor_item", _F, [_P]),
    ("dt_tensor_data", _P, [_P]),
    ("dt_tensor_stride", _I64, [_P, _I]),
    ("dt_tensor_ndim", _I, [_P]),
    ("dt_tensor_dim", _I64, [_P, _I]),
    ("dt_tensor_numel", _I64, [_P]),
    ("dt_tensor_dtype", _I, [_P]),
    ("dt_tensor_name", _S, [_P]),
    ("dt_tensor_grad", _P, [_P]),
    ("dt_tensor_retain_grad", _I, [_P]),
    ("dt_tensor_requires_grad", _I, [_P]),
    ("dt_tensor_set_requires_grad", _I, [_P, _I]),
    # parameters and init
    ("dt_param_new", _P, [_P, _S, _I, _I64P]),
    ("dt_param_count", _I, [_P]),
    ("dt_param_at", _P, [_P, _I]),
    ("dt_param_find", _P, [_P, _S]),
    ("dt_ctx_zero_grad", None, [_P]),
    ("dt_tensor_init_uniform", _I, [_P, _P, _F, _F]),
    ("dt_tensor_init_normal", _I, [_P, _P, _F, _F]),
    ("dt_tensor_init_kaiming_uniform", _I, [_P, _P, _F]),
    ("dt_tensor_init_kaiming_normal", _I, [_P, _P, _F]),
    ("dt_tensor_init_xavier_uniform", _I, [_P, _P, _F]),
    ("dt_tensor_init_xavier_normal", _I, [_P, _P, _F]),
    ("dt_tensor_init_bias", _I, [_P, _P, _I64]),
    # ops
    ("dt_reshape", _P, [_P, _P, _I, _I64P]),
    ("dt_flatten", _P, [_P, _P, _I]),
    ("dt_transpose", _P, [_P, _P, _I, _I]),
    ("dt_slice", _P, [_P, _P, _I, _I64, _I64]),
    ("dt_contiguous", _P, [_P, _P]),
    ("dt_concat", _P, [_P, ctypes.POINTER(_P), _I, _I]),
    ("dt_matmul", _P, [_P, _P, _P, _I, _I]),
    ("dt_linear", _P, [_P, _P, _P, _P]),
    ("dt_add", _P, [_P, _P, _P]),
    ("dt_sub", _P, [_P, _P, _P]),
    ("dt_mul", _P, [_P, _P, _P]),
    ("dt_div", _P, [_P, _P, _P]),
    ("dt_scale", _P, [_P, _P, _F]),
    ("dt_sum", _P, [_P, _P]),
    ("dt_mean", _P, [_P, _P]),
    ("dt_sum_dim", _P, [_P, _P, _I, _I]),
    ("dt_mean_dim", _P, [_P, _P, _I, _I]),
    ("dt_relu", _P, [_P, _P]),
    ("dt_gelu", _P, [_P, _P]),
    ("dt_gelu_tanh", _P, [_P, _P]),
    ("dt_permute", _P, [_P, _P, _I, ctypes.POINTER(_I)]),
    ("dt_pow", _P, [_P, _P, _P]),
    ("dt_pow_scalar", _P, [_P, _P, _F]),
    ("dt_where", _P, [_P, _P, _P, _P]),
    ("dt_masked_fill", _P, [_P, _P, _P, _F]),
    ("dt_exp", _P, [_P, _P]),
    ("dt_log", _P, [_P, _P]),
    ("dt_sqrt", _P, [_P, _P]),
    ("dt_attention", _P, [_P, _P, _P, _P, _P, _I, _F]),
    ("dt_cross_entropy_ignore", _P, [_P, _P, _P, _I]),
    ("dt_linear_params", _I, [_P, _S, _I64, _I64, _I, ctypes.POINTER(_P), ctypes.POINTER(_P)]),
    ("dt_conv2d_params", _I, [_P, _S, _I64, _I64, _I, _I, ctypes.POINTER(_P),
                              ctypes.POINTER(_P)]),
    ("dt_embedding_params", _P, [_P, _S, _I64, _I64]),
    ("dt_layer_norm_params", _I, [_P, _S, _I64, _I, ctypes.POINTER(_P), ctypes.POINTER(_P)]),
    ("dt_tanh", _P, [_P, _P]),
    ("dt_sigmoid", _P, [_P, _P]),
    ("dt_softmax", _P, [_P, _P, _I]),
    ("dt_log_softmax", _P, [_P, _P, _I]),
    ("dt_cross_entropy", _P, [_P, _P, _P]),
    ("dt_mse", _P, [_P, _P, _P]),
    ("dt_conv2d", _P, [_P, _P, _P, _P, _I, _I]),
    ("dt_max_pool2d", _P, [_P, _P, _I, _I, _I]),
    ("dt_avg_pool2d", _P, [_P, _P, _I, _I, _I]),
    ("dt_embedding", _P, [_P, _P, _P]),
    ("dt_layer_norm", _P, [_P, _P, _P, _P, _F]),
    ("dt_dropout", _P, [_P, _P, _F]),
    ("dt_backward", _I, [_P, _P]),
    ("dt_ctx_clip_grad_norm", _I, [_P, _F, ctypes.POINTER(_F)]),
    ("dt_count_correct", _I, [_P, _P, _P, ctypes.POINTER(_I64)]),
    ("dt_now", _D, []),
    # optimizers
    ("dt_optim_config_init", None, [ctypes.POINTER(dt_optim_config), _I]),
    ("dt_optim_new", _P, [_P, ctypes.POINTER(dt_optim_config), ctypes.POINTER(_P), _I]),
    ("dt_ctx_set_activity", _I, [_P, _S]),
    ("dt_ctx_activity", _S, [_P]),
    ("dt_param_group_init", None, [ctypes.POINTER(dt_param_group), ctypes.POINTER(_P), _I]),
    ("dt_optim_new_groups", _P, [_P, ctypes.POINTER(dt_optim_config),
                                 ctypes.POINTER(dt_param_group), _I]),
    ("dt_optim_group_count", _I, [_P]),
    ("dt_optim_group_of", _I, [_P, _P]),
    ("dt_optim_group_config", _I, [_P, _I, ctypes.POINTER(dt_optim_config)]),
    ("dt_optim_set_group_lr", _I, [_P, _I, _F]),
    ("dt_optim_free", None, [_P]),
    ("dt_optim_step", _I, [_P]),
    ("dt_optim_zero_grad", None, [_P]),
    ("dt_optim_lr", _F, [_P]),
    ("dt_optim_set_lr", _I, [_P, _F]),
    ("dt_optim_steps", _I64, [_P]),
    ("dt_optim_set_schedule", _I, [_P, ctypes.POINTER(dt_schedule)]),
    ("dt_schedule_lr", _F, [ctypes.POINTER(dt_schedule), _F, _I64]),
    # checkpoints
    # data
    ("dt_dataset_load_idx", _P, [_P, _S, _S]),
    ("dt_dataset_free", None, [_P]),
    ("dt_dataset_size", _I64, [_P]),
    ("dt_dataset_sample_shape", _I, [_P, _I64P]),
    ("dt_dataset_classes", _I, [_P]),
    ("dt_dataset_image", _P, [_P, _I64]),
    ("dt_dataset_label", _I, [_P, _I64]),
    ("dt_dataset_from_memory", _P, [_P, _I64, ctypes.POINTER(dt_sample_field), _P,
                                    ctypes.POINTER(dt_sample_field), _P, _I]),
    ("dt_dataset_load_npy", _P, [_P, _S, _S]),
    ("dt_csv_config_init", None, [ctypes.POINTER(dt_csv_config)]),
    ("dt_dataset_load_csv", _P, [_P, _S, ctypes.POINTER(dt_csv_config)]),
    ("dt_token_config_init", None, [ctypes.POINTER(dt_token_config)]),
    ("dt_dataset_from_tokens", _P, [_P, _P, _I64, _I, _I, ctypes.POINTER(dt_token_config)]),
    ("dt_dataset_subset", _P, [_P, _P, _I64, _I64]),
    ("dt_dataset_normalize", _I, [_P, _I, _I, _FP, _FP]),
    ("dt_dataset_stats", _I, [_P, _I, _FP, _FP]),
    ("dt_loader_config_init", None, [ctypes.POINTER(dt_loader_config)]),
    ("dt_loader_new", _P, [_P, _P, ctypes.POINTER(dt_loader_config)]),
    ("dt_loader_free", None, [_P]),
    ("dt_loader_start_epoch", _I, [_P, _I64]),
    ("dt_loader_next", _I, [_P, ctypes.POINTER(_P), ctypes.POINTER(_P)]),
    ("dt_loader_batches", _I64, [_P]),
    ("dt_loader_wait_seconds", _D, [_P]),
    # processes
    ("dt_dist_env_detect", _I, [_P, ctypes.POINTER(dt_dist_env)]),
    ("dt_comm_config_init", None, [ctypes.POINTER(dt_comm_config)]),
    ("dt_comm_new", _P, [_P, ctypes.POINTER(dt_dist_env), ctypes.POINTER(dt_comm_config)]),
    ("dt_comm_free", None, [_P]),
    ("dt_comm_rank", _I, [_P]),
    ("dt_comm_size", _I, [_P]),
    ("dt_comm_transport", _S, [_P]),
    ("dt_comm_allreduce", _I, [_P, _P, _I64, _I]),
    ("dt_comm_broadcast", _I, [_P, _P, _I64, _I]),
    ("dt_comm_allgather", _I, [_P, _P, _I64, _P]),
    ("dt_comm_barrier", _I, [_P]),
    # DDP and evaluation
    ("dt_ddp_config_init", None, [ctypes.POINTER(dt_ddp_config)]),
    ("dt_ddp_new", _P, [_P, _P, _P, ctypes.POINTER(dt_ddp_config)]),
    ("dt_ddp_free", None, [_P]),
    ("dt_ddp_set_sync", _I, [_P, _I]),
    ("dt_ddp_full_params", _I, [_P]),
    ("dt_ddp_checkpoint_save", _I, [_P, _P, _S, _I64]),
    ("dt_ddp_checkpoint_load", _I, [_P, _P, _S, ctypes.POINTER(_I64)]),
    ("dt_checkpoint_consolidate", _I, [_P, _S, _S]),
    ("dt_ddp_sync", _I, [_P]),
    ("dt_ddp_step", _I, [_P]),
    ("dt_ddp_stats_get", _I, [_P, ctypes.POINTER(dt_ddp_stats)]),
    ("dt_ddp_stats_reset", None, [_P]),
    ("dt_eval_config_init", None, [ctypes.POINTER(dt_eval_config)]),
    ("dt_evaluate", _I, [_P, _P, _P, ctypes.POINTER(dt_eval_config), _FORWARD_FN, _P,
                         ctypes.POINTER(dt_metrics)]),
    # point to point, groups, model parallelism
    ("dt_comm_split", _P, [_P, _I, _I, ctypes.POINTER(dt_comm_config)]),
    ("dt_comm_job_rank", _I, [_P, _I]),
    ("dt_comm_send", _I, [_P, _P, _I64, _I]),
    ("dt_comm_recv", _I, [_P, _P, _I64, _I]),
    ("dt_comm_sendrecv", _I, [_P, _P, _I64, _I, _P, _I64, _I]),
    ("dt_pipe_config_init", None, [ctypes.POINTER(dt_pipe_config)]),
    ("dt_pipe_new", _P, [_P, _P, ctypes.POINTER(dt_pipe_config), _STAGE_FN, _P]),
    ("dt_pipe_free", None, [_P]),
    ("dt_pipe_step", _I, [_P, _P, _P, ctypes.POINTER(_F)]),
    ("dt_pipe_stage", _I, [_P]),
    ("dt_pipe_stages", _I, [_P]),
    ("dt_pipe_stats_get", _I, [_P, ctypes.POINTER(dt_pipe_stats)]),
    ("dt_pipe_stats_reset", None, [_P]),
    ("dt_profile_layer_times", _I, [_P, _P, _P, _P, _I, _P, _I, ctypes.POINTER(_D)]),
    ("dt_pipe_partition", _I, [ctypes.POINTER(_D), _I, _I, ctypes.POINTER(_I)]),
    ("dt_tp_copy", _P, [_P, _P, _P]),
    ("dt_tp_reduce", _P, [_P, _P, _P]),
    ("dt_tp_gather", _P, [_P, _P, _P]),
    ("dt_tp_split", _P, [_P, _P, _P]),
    ("dt_tp_linear_col", _P, [_P, _P, _P, _P, _P, _I]),
    ("dt_tp_linear_row", _P, [_P, _P, _P, _P, _P, _I]),
    ("dt_tp_shard", _I, [_P, _P, _I, _P]),
    # profiler
    ("dt_profile_config_init", None, [ctypes.POINTER(dt_profile_config)]),
    ("dt_profile_start", _I, [_P, ctypes.POINTER(dt_profile_config)]),
    ("dt_profile_active", _I, [_P]),
    ("dt_profile_stats_get", _I, [_P, ctypes.POINTER(dt_profile_stats)]),
    ("dt_profile_stop", _I, [_P, _P, _S]),
    ("dt_profile_report", _S, [_P]),
    ("dt_profile_straggler", _I, [_P]),
]:
    setattr(_C, _name[3:], _fn(_name, _res, *_args))

# callbacks: (ctx, inputs, n, user) -> tensor; (ctx, inputs, n, out, dout, grads, user) -> status
_CUSTOM_FWD = ctypes.CFUNCTYPE(_P, _P, ctypes.POINTER(_P), _I, _P)
_CUSTOM_BWD = ctypes.CFUNCTYPE(_I, _P, ctypes.POINTER(_P), _I, _P, _P, ctypes.POINTER(_P), _P)
_SEGMENT_FN = ctypes.CFUNCTYPE(_P, _P, ctypes.POINTER(_P), _I, _P)
_SAMPLE_FN = ctypes.CFUNCTYPE(_I, _P, _I64, _P, _P)   # (user, i, input, target) -> 0 ok
_BUILD_FN = ctypes.CFUNCTYPE(_P, _P, _I, _P)          # (ctx, replica, user) -> model
_FREE_FN = ctypes.CFUNCTYPE(None, _P, _P)             # (model, user)
_DP_LOSS_FN = ctypes.CFUNCTYPE(_P, _P, _P, _P, _P, _P)   # (ctx, model, x, y, user)
_HW_LOSS_FN = ctypes.CFUNCTYPE(_P, _P, _P, _I, _I64, _P)  # (ctx, model, thread, step, user)

# The rest of dtrain.h: each area in the order of its section there.
for _name, _res, _args in [
    ("dt_version_string", _S, []),
    ("dt_dtype_name", _S, [_I]),
    ("dt_dtype_size", _SZ, [_I]),
    ("dt_mem_peak_reset", None, [_P]),
    ("dt_tensor_temp", _P, [_P, _I, _I, _I64P]),
    ("dt_tensor_is_contiguous", _I, [_P]),
    ("dt_tensor_set_name", _I, [_P, _S]),
    ("dt_custom_op", _P, [_P, _S, ctypes.POINTER(_P), _I, _CUSTOM_FWD, _CUSTOM_BWD, _P]),
    ("dt_recompute", _P, [_P, _SEGMENT_FN, ctypes.POINTER(_P), _I, _P]),
    ("dt_ctx_set_autocast", _I, [_P, _I]),
    ("dt_ctx_autocast", _I, [_P]),
    ("dt_optim_state_count", _I, [_P]),
    ("dt_optim_state_at", _P, [_P, _I]),
    ("dt_loss_scale_config_init", None, [ctypes.POINTER(dt_loss_scale_config)]),
    ("dt_loss_scaler_new", _P, [_P, ctypes.POINTER(dt_loss_scale_config)]),
    ("dt_loss_scaler_free", None, [_P]),
    ("dt_loss_scaler_backward", _I, [_P, _P]),
    ("dt_loss_scaler_unscale", _I, [_P, ctypes.POINTER(_I)]),
    ("dt_loss_scaler_step", _I, [_P, _P, ctypes.POINTER(_I)]),
    ("dt_loss_scaler_scale", _F, [_P]),
    ("dt_loss_scaler_skipped", _I64, [_P]),
    ("dt_checkpoint_config_init", None, [ctypes.POINTER(dt_checkpoint_config)]),
    ("dt_checkpoint_save", _I, [_P, _P, _S, _I64, ctypes.POINTER(dt_checkpoint_config)]),
    ("dt_checkpoint_load", _I, [_P, _P, _S, ctypes.POINTER(dt_checkpoint_config),
                                ctypes.POINTER(_I64), ctypes.POINTER(dt_checkpoint_report)]),
    ("dt_checkpoint_latest", _I, [_P, _S, ctypes.c_char_p, _SZ, ctypes.POINTER(_I64)]),
    ("dt_checkpoint_metadata", _I, [_P, _S, _S, ctypes.c_char_p, _SZ]),
    ("dt_dataset_load_raw", _P, [_P, _S, ctypes.POINTER(dt_sample_field), _S,
                                 ctypes.POINTER(dt_sample_field)]),
    ("dt_dataset_load_tokens", _P, [_P, _S, _I, ctypes.POINTER(dt_token_config)]),
    ("dt_dataset_from_callback", _P, [_P, _I64, ctypes.POINTER(dt_sample_field),
                                      ctypes.POINTER(dt_sample_field), _SAMPLE_FN, _P]),
    ("dt_dataset_fields", _I, [_P, ctypes.POINTER(dt_sample_field),
                               ctypes.POINTER(dt_sample_field)]),
    ("dt_dataset_sample", _I, [_P, _I64, _P, _P]),
    ("dt_loader_batch_slice", None, [_P, _I64P, _I64P, _I64P]),
    ("dt_loader_set_split", _I, [_P, ctypes.POINTER(_D), _I]),
    ("dt_loader_steal", _I, [_P, _P, _I]),
    ("dt_loader_batches_done", _I64, [_P]),
    ("dt_loader_batches_stolen", _I64, [_P]),
    ("dt_store_config_init", None, [ctypes.POINTER(dt_store_config)]),
    ("dt_store_new", _P, [_P, ctypes.POINTER(dt_dist_env), ctypes.POINTER(dt_store_config)]),
    ("dt_store_free", None, [_P]),
    ("dt_store_port", _I, [_P]),
    ("dt_store_set", _I, [_P, _S, _P, _SZ]),
    ("dt_store_get", _I, [_P, _S, _P, _SZ, ctypes.POINTER(_SZ), _I]),
    ("dt_store_add", _I, [_P, _S, _I64, ctypes.POINTER(_I64)]),
    ("dt_comm_hosts", _I, [_P]),
    ("dt_comm_intra_host", _S, [_P]),
    ("dt_comm_bytes_sent", _U64, [_P]),
    ("dt_comm_allreduce_async", _P, [_P, _P, _I64, _I]),
    ("dt_work_wait", _I, [_P]),
    ("dt_comm_reduce_scatter", _I, [_P, _P, _I64, _P, _I]),
    ("dt_comm_alltoall", _I, [_P, _P, _I64, _P]),
    ("dt_spawn_config_init", None, [ctypes.POINTER(dt_spawn_config)]),
    ("dt_spawn", _I, [_P, ctypes.POINTER(dt_spawn_config), ctypes.POINTER(_I)]),
    ("dt_launch", _I, [_P, ctypes.POINTER(dt_spawn_config), ctypes.POINTER(_S),
                       ctypes.POINTER(_I)]),
    ("dt_ddp_balance", _I, [_P, _P, _I]),
    ("dt_ddp_balance_share", _D, [_P]),
    ("dt_dp_config_init", None, [ctypes.POINTER(dt_dp_config)]),
    ("dt_dp_new", _P, [_P, ctypes.POINTER(dt_dp_config), _BUILD_FN, _DP_LOSS_FN, _FREE_FN, _P]),
    ("dt_dp_free", None, [_P]),
    ("dt_dp_step", _I, [_P, _P, _P, ctypes.POINTER(_F)]),
    ("dt_dp_replicas", _I, [_P]),
    ("dt_dp_replica", _P, [_P, _I]),
    ("dt_dp_model", _P, [_P, _I]),
    ("dt_hogwild_config_init", None, [ctypes.POINTER(dt_hogwild_config)]),
    ("dt_hogwild_run", _I, [_P, ctypes.POINTER(dt_hogwild_config), _BUILD_FN, _HW_LOSS_FN,
                            _FREE_FN, _P, ctypes.POINTER(dt_hogwild_stats)]),
    ("dt_predict", _I, [_P, _P, _P, ctypes.POINTER(dt_eval_config), _FORWARD_FN, _P,
                        ctypes.POINTER(ctypes.c_int32)]),
    ("dt_ps_config_init", None, [ctypes.POINTER(dt_ps_config)]),
    ("dt_ps_new", _P, [_P, _P, ctypes.POINTER(dt_ps_config)]),
    ("dt_ps_free", None, [_P]),
    ("dt_ps_is_server", _I, [_P]),
    ("dt_ps_workers", _I, [_P]),
    ("dt_ps_servers", _I, [_P]),
    ("dt_ps_serve", _I, [_P]),
    ("dt_ps_push_pull", _I, [_P]),
    ("dt_ps_push", _I, [_P]),
    ("dt_ps_pull", _I, [_P]),
    ("dt_ps_finish", _I, [_P]),
    ("dt_ps_sparse_pull", _I, [_P, _I, _I64P, _I64, _FP]),
    ("dt_ps_sparse_pull_async", _P, [_P, _I, _I64P, _I64, _FP]),
    ("dt_ps_sparse_push", _I, [_P, _I, _I64P, _I64, _FP]),
    ("dt_ps_stats_get", _I, [_P, ctypes.POINTER(dt_ps_stats)]),
    ("dt_profile_rank_stats_get", _I, [_P, _I, ctypes.POINTER(dt_profile_stats)]),
    ("dt_monitor_config_init", None, [ctypes.POINTER(dt_monitor_config)]),
    ("dt_monitor_new", _P, [_P, _P, ctypes.POINTER(dt_monitor_config)]),
    ("dt_monitor_free", None, [_P]),
    ("dt_monitor_port", _I, [_P]),
    ("dt_monitor_log", _I, [_P, _S, _I64, _D]),
    ("dt_preempt_config_init", None, [ctypes.POINTER(dt_preempt_config)]),
    ("dt_preempt_enable", _I, [_P, ctypes.POINTER(dt_preempt_config)]),
    ("dt_preempt_signal", _I, [_P]),
    ("dt_preempt_agree", _I, [_P, _P, _I64, ctypes.POINTER(_I)]),
    ("dt_preempt_saved", _I, [_P, _D]),
    ("dt_preempt_report", _S, [_P]),
]:
    setattr(_C, _name[3:], _fn(_name, _res, *_args))

def now() -> float:
    """Seconds on a monotonic clock (dt_now): for timing steps, as time.perf_counter."""
    return _C.now()

# The C API this module mirrors: the library it loaded must be this release's
# (major and minor), and every struct it mirrors must have the library's size.
API_VERSION = (0, 1)


def _check_library(version, struct_size, path=None):
    """Refuse (ImportError, saying what and where) a library of another release, or
    one whose struct sizes differ from this module's mirrors.  version: dt_version();
    struct_size(name) -> dt_struct_size."""
    path = path or library_path
    if (version // 10000, version // 100 % 100) != API_VERSION:
        raise ImportError("dtrain: %s is version %d.%d.%d; this module mirrors the C API of %d.%d "
                          "(use the dtrain.py of that release, or that library)"
                          % ((path, version // 10000, version // 100 % 100, version % 100)
                             + API_VERSION))
    for cls in _MIRRORED:
        n = struct_size(cls.__name__.encode())
        if n != ctypes.sizeof(cls):
            raise ImportError("dtrain: %s's %s is %d bytes, this module's %d: the library and the "
                              "module are from different builds" % (path, cls.__name__, n,
                                                                    ctypes.sizeof(cls)))


for _cls in _STRUCTS:
    _cls.__doc__ = ("dtrain.h's struct %s, mirrored field for field (its size is checked "
                    "against the library's at import)." % _cls.__name__)

_MIRRORED = [c for c in list(globals().values())
             if isinstance(c, type) and issubclass(c, ctypes.Structure) and c.__name__.startswith("dt_")]
try:
    _version = _fn("dt_version", _I)
    _struct_size = _fn("dt_struct_size", _SZ, _S)
except AttributeError:
    raise ImportError("dtrain: %s has no dt_version or dt_struct_size: a library older than this "
                      "module" % library_path) from None
_check_library(_version(), _struct_size)


def _b(s):
    return None if s is None else s.encode()


# --- 4. errors ------------------------------------------------------------------------------

class Error(Exception):
    """A dtrain call failed; str(e) is the C library's message, e.status its dt_status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class InvalidArgument(Error, ValueError):
    """DT_EINVAL: a bad argument (NULL, wrong shape or dtype, out of range)."""


class OutOfMemory(Error, MemoryError):
    """DT_ENOMEM: an allocation failed (host or device)."""


class FileError(Error, OSError):
    """DT_EIO: a file could not be read or written (or a device failed)."""


class CorruptFile(Error):
    """DT_ECORRUPT: a file is damaged or not what it claims to be."""


class Mismatch(Error, ValueError):
    """DT_EMISMATCH: ranks, files or models disagree."""


class NotSupported(Error, NotImplementedError):
    """DT_ENOTSUP: not available in this build or on this backend."""


class BadState(Error, RuntimeError):
    """DT_ESTATE: called at the wrong time (a closed object, a used-up graph, ...)."""


class Timeout(Error, TimeoutError):
    """DT_ETIMEDOUT: a peer or the store did not answer in time."""


class PeerError(Error, ConnectionError):
    """DT_EPEER: a peer died, or sent something malformed."""


class Preempted(Error):
    """DT_EPREEMPTED: a launched job was pre-empted (its ranks saved and exited
    EXIT_PREEMPTED)."""


EXIT_PREEMPTED = 75   # DT_EXIT_PREEMPTED: what a pre-empted rank exits with (sys.exit)

_ERRORS = {1: InvalidArgument, 2: OutOfMemory, 3: FileError, 4: CorruptFile, 5: Mismatch,
           6: NotSupported, 7: BadState, 8: Timeout, 9: PeerError, 11: Preempted}
_EOF = 10

_DTYPES = {0: np.float32, 1: np.int32, 2: np.uint8, 3: np.uint16, 4: np.float16}   # bf16: its bits
_DT_OF = {np.dtype(np.float32): 0, np.dtype(np.int32): 1, np.dtype(np.uint8): 2}


def _error(status, message):
    return _ERRORS.get(status, Error)(status, message)


# --- 5. the context -------------------------------------------------------------------------

class _Life:
    """What a borrowed or step handle's validity hangs on: alive while gen is unchanged."""
    __slots__ = ("gen",)

    def __init__(self):
        self.gen = 0


class Context:
    """dt_ctx: a backend, the parameters, the step arena and the last error.

    Used by one thread at a time (as in C).  close() frees everything made
    from it: optimizers, loaders, DDPs, communicators and tensors.
    arena_max_bytes caps the step arena (0: the host's memory): step tensors
    live until step_reset(), and past the cap a step raises OutOfMemory
    saying to call it (dt_ctx_config.arena_max_bytes)."""

    def __init__(self, backend: str = "cpu", threads: int = 1, seed: int = 0, device: int = 0,
                 arena_bytes: int = 0, arena_max_bytes: int = 0) -> None:
        cfg = dt_ctx_config()
        _C.ctx_config_init(ctypes.byref(cfg))
        cfg.backend = _b(backend)
        cfg.threads = threads
        cfg.seed = seed
        cfg.device = device
        cfg.arena_bytes = arena_bytes
        cfg.arena_max_bytes = arena_max_bytes
        self._h = _C.ctx_new(ctypes.byref(cfg))
        if not self._h:
            raise OutOfMemory(2, "dt_ctx_new: out of memory")
        self.step = _Life()   # step tensors die when step.gen moves on
        self._children = []   # weakrefs of what must be freed before the context
        self._deferred = []   # persistent tensors to free at the next step_reset
        self._log = None
        self._borrowed = False
        self._backward_failure, self._in_backward = [], False   # exceptions of callbacks
        self.persist = _Life()   # borrowed tensors that live as long as the context (grads)
        self._views = 0          # live NumPy views of memory of this context (_View)
        self._zombie = None      # the C context, closed but kept for those views
        st = _C.ctx_status(self._h)
        if st:
            msg = _C.last_error(self._h).decode()
            _C.ctx_free(self._h)
            self._h = None
            raise _error(st, msg)

    # handles and errors
    @property
    def handle(self) -> int:
        """The C handle (dt_ctx *); BadState once closed."""
        if not self._h:
            raise BadState(7, "the context is closed")
        return self._h

    def error(self) -> "Error":
        """The exception for the context's last error."""
        return _error(_C.last_status(self._h) or 1, _C.last_error(self._h).decode())

    def check(self, status: int) -> None:
        """Raise the Error for a failed dt_status (0: nothing)."""
        if status:
            raise _error(status, _C.last_error(self._h).decode())

    def _adopt(self, obj):
        if len(self._children) > 64:
            self._children = [r for r in self._children if r() is not None]
        self._children.append(weakref.ref(obj))

    def close(self) -> None:
        """Free the context and everything made from it (dt_ctx_free)."""
        if not self._h:
            return
        for order in range(4):   # DDPs, then loaders/optimizers, datasets, communicators
            for ref in self._children:
                obj = ref()
                if obj is not None and obj._close_order == order:
                    obj.close()
        self._children = []
        self._deferred = []
        self.step.gen += 1
        self.persist.gen += 1
        h, self._h = self._h, None
        if self._borrowed:
            return
        if self._views:
            self._zombie = h   # NumPy arrays still read its memory: freed with the last
        else:
            _C.ctx_free(h)

    def _view_gone(self):
        """A _View of this context's memory was collected: free a closed context
        with the last."""
        self._views -= 1
        if self._views == 0 and self._zombie:
            z, self._zombie = self._zombie, None
            _C.ctx_free(z)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # state
    @property
    def backend(self) -> str:
        """The backend's name: "cpu", "cuda", ..."""
        return _C.backend_name(self.handle).decode()

    @property
    def threads(self) -> int:
        """Compute threads of the backend."""
        return _C.ctx_threads(self.handle)

    @property
    def grad_enabled(self) -> bool:
        """Whether ops record the tape (see no_grad)."""
        return bool(_C.ctx_grad_enabled(self.handle))

    @grad_enabled.setter
    def grad_enabled(self, on: bool) -> None:
        _C.ctx_set_grad_enabled(self.handle, int(bool(on)))

    @property
    def training(self) -> bool:
        """Training mode (dropout on); False for evaluation."""
        return bool(_C.ctx_training(self.handle))

    @training.setter
    def training(self, on: bool) -> None:
        _C.ctx_set_training(self.handle, int(bool(on)))

    def seed(self, seed: int) -> None:
        """Reseed the context's generator (init and dropout derive from it)."""
        _C.ctx_seed(self.handle, seed)

    def set_log(self, fn: Optional[Callable[[str], None]]) -> None:
        """Warnings go to fn(message) (on the thread that met them); None: back to stderr
        when DTRAIN_LOG is set."""
        if fn is None:
            self._log = None
            _C.ctx_set_log(self.handle, _LOG_FN(), None)
            return
        self._log = _LOG_FN(lambda user, msg: fn(msg.decode(errors="replace")))
        _C.ctx_set_log(self.handle, self._log, None)

    def set_activity(self, what: Optional[str]) -> None:
        """Say what this rank is doing ("evaluating", "compiling"): ranks waiting for it in
        a collective show it in their errors, and the monitor shows it; None: the library's
        own again (dt_ctx_set_activity)."""
        self.check(_C.ctx_set_activity(self.handle, _b(what)))

    @property
    def activity(self) -> str:
        """What waiting peers see this rank doing: "waiting for its data loader for 25 s"
        (dt_ctx_activity)."""
        return _C.ctx_activity(self.handle).decode()

    _PREEMPT_BITS = {"TERM": 1, "USR1": 2, "USR2": 4, "INT": 8}

    def preempt_enable(self, signals: Sequence[str] = ("TERM", "USR1", "USR2")) -> None:
        """Catch these signals (names without SIG) from now on: the first asks the job to
        stop after the current step (preempt_agree), a second ends the process.  Every rank
        calls it before its first step (dt_preempt_enable; DTRAIN_PREEMPT_SIGNALS
        overrides).  Replaces Python's own handler for a signal named here."""
        c = dt_preempt_config()
        _C.preempt_config_init(ctypes.byref(c))
        try:
            bits = [self._PREEMPT_BITS[n.upper().replace("SIG", "", 1)] for n in signals]
            c.signals = functools.reduce(operator.or_, bits, 0)
        except KeyError as e:
            raise InvalidArgument(1, "preempt_enable: unknown signal %s (TERM, USR1, USR2, INT)"
                                  % e) from None
        self.check(_C.preempt_enable(self.handle, ctypes.byref(c)))

    @property
    def preempt_signal(self) -> int:
        """The pre-emption signal this process received (signal.SIGTERM, ...), 0: none."""
        return _C.preempt_signal(self.handle)

    def preempt_agree(self, comm: Optional["Comm"], step: int) -> bool:
        """After each step, on every rank: True on every rank when any rank received a
        pre-emption signal; then save a checkpoint, call preempt_saved() and
        sys.exit(dtrain.EXIT_PREEMPTED).  step: the steps done (the report's N).  Free
        after a DDP's step, which voted already (dt_preempt_agree)."""
        stop = _I(0)
        self.check(_C.preempt_agree(self.handle, comm.handle if comm else None, step,
                                    ctypes.byref(stop)))
        return bool(stop.value)

    def preempt_saved(self, seconds: float = -1.0) -> None:
        """The stop's checkpoint is written (seconds < 0: the time since the agreement)."""
        self.check(_C.preempt_saved(self.handle, seconds))

    @property
    def preempt_report(self) -> str:
        """"pre-empted at step N (SIGTERM), checkpoint saved in S s", or ""."""
        return _C.preempt_report(self.handle).decode()

    @property
    def last_warning(self) -> str:
        """The latest warning (a dropped worker, a straggler, ...), or ""."""
        return _C.last_warning(self.handle).decode()

    def mem_stats(self) -> Dict[str, int]:
        """The step arena's and persistent memory's sizes, as a dict (dt_mem_stats)."""
        s = dt_mem_stats()
        _C.mem_stats_get(self.handle, ctypes.byref(s))
        return {f: getattr(s, f) for f, _ in s._fields_}

    # the step
    def step_reset(self) -> None:
        """Free this step's tensors and tape (dt_ctx_step_reset): once per training step."""
        _C.ctx_step_reset(self.handle)
        self._step_ended()

    def _step_ended(self):
        self.step.gen += 1
        # the tape that may have held them is gone: now they can go
        deferred, self._deferred = self._deferred, []
        for h, _keep in deferred:
            if h is not None:   # (None: callbacks kept for the step, _keep_for_step)
                _C.tensor_free(h)

    def _run_backward(self, call):
        """call() runs a backward; an exception of a custom op's or recomputed segment's
        callback during it comes out here, before the C status."""
        self._backward_failure, self._in_backward = [], True
        try:
            st = call()
        finally:
            self._in_backward = False
        if self._backward_failure:
            e, self._backward_failure = self._backward_failure[0], []
            raise e
        self.check(st)

    def backward(self, loss: "Tensor") -> None:
        """Back-propagate from a scalar loss; parameter gradients accumulate until zero_grad."""
        self._run_backward(lambda: _C.backward(self.handle, loss.handle))

    def no_grad(self) -> "_Scoped":
        """with ctx.no_grad(): ops record no tape (torch.no_grad)."""
        def enter():
            old = self.grad_enabled
            self.grad_enabled = False
            return old

        return _Scoped(enter, lambda old: setattr(self, "grad_enabled", old))

    @property
    def autocast_precision(self) -> str:
        """The mixed precision matmul, linear and conv2d run at: f32, tf32, bf16 or fp16."""
        return _PRECISION_NAMES[_C.ctx_autocast(self.handle)]

    def set_autocast(self, precision: str) -> None:
        """Set the mixed precision of matmul, linear and conv2d: "f32", "tf32", "bf16" or "fp16"."""
        if precision not in _PRECISIONS:
            raise InvalidArgument(1, "autocast: one of %s" % ", ".join(_PRECISIONS))
        self.check(_C.ctx_set_autocast(self.handle, _PRECISIONS[precision]))

    def autocast(self, precision: str = "bf16") -> "_Scoped":
        """with ctx.autocast("bf16"): mixed precision for the forward (torch.autocast)."""
        def enter():
            old = self.autocast_precision
            self.set_autocast(precision)
            return old

        return _Scoped(enter, self.set_autocast)

    def mem_reset_peak(self) -> None:
        """Start mem_stats()' arena_peak again from what is used now."""
        _C.mem_peak_reset(self.handle)

    def temp(self, shape: Sequence[int], dtype: Any = np.float32) -> "Tensor":
        """A zero-filled step tensor (gone at step_reset), e.g. a custom op's output."""
        shape = tuple(shape)
        h = _C.tensor_temp(self.handle, _dtype_code(dtype), len(shape), _shape(shape))
        return Tensor._made(self, h, self.step)

    def zero_grad(self) -> None:
        """Zero every parameter's gradient."""
        _C.ctx_zero_grad(self.handle)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradients to a global L2 norm of at most max_norm; the norm before."""
        norm = _F()
        self.check(_C.ctx_clip_grad_norm(self.handle, max_norm, ctypes.byref(norm)))
        return norm.value

    # tensors
    def tensor(self, shape: Sequence[int], dtype: Any = np.float32) -> "Tensor":
        """A new zero-filled persistent tensor."""
        shape = tuple(shape)
        h = _C.tensor_new(self.handle, _dtype_code(dtype), len(shape), _shape(shape))
        return Tensor._made(self, h, None, owned=True)

    def from_numpy(self, array: np.ndarray, copy: bool = False) -> "Tensor":
        """A persistent tensor with the array's contents: its memory itself (no copy) when
        the array is C-contiguous, aligned, of float32/int32/uint8, and the backend computes
        on host memory; else (or copy=True) a copy, float arrays as float32."""
        a = np.asarray(array)
        if a.dtype not in _DT_OF:
            a = a.astype(np.float32 if a.dtype.kind == "f" else np.int32)
        shape = a.shape
        if (not copy and a.flags.c_contiguous and a.flags.aligned and a.flags.writeable
                and self.backend == "cpu"):
            h = _C.tensor_wrap(self.handle, _DT_OF[a.dtype], a.ndim, _shape(shape),
                               a.ctypes.data)
            t = Tensor._made(self, h, None, owned=True)
            t._keep = a
            return t
        a = np.ascontiguousarray(a)
        t = self.tensor(shape, a.dtype)
        self.check(_C.tensor_set(t.handle, a.ctypes.data, a.size))
        return t

    # parameters
    def param(self, name: str, shape: Sequence[int]) -> "Tensor":
        """A new parameter (zero-filled, requires grad), owned by the context."""
        shape = tuple(shape)
        h = _C.param_new(self.handle, _b(name), len(shape), _shape(shape))
        return Tensor._made(self, h, None)

    def _pair(self, fn, *args):
        w, b = _P(), _P()
        self.check(fn(self.handle, *args, ctypes.byref(w), ctypes.byref(b)))
        return (Tensor._made(self, w.value, None),
                Tensor._made(self, b.value, None) if b.value else None)

    def linear_params(self, name: str, in_features: int, out_features: int,
                      bias: bool = True) -> Tuple["Tensor", Optional["Tensor"]]:
        """(weight (out, in), bias (out) or None) as nn.Linear initialises them."""
        return self._pair(_C.linear_params, _b(name), in_features, out_features, int(bias))

    def conv2d_params(self, name: str, in_channels: int, out_channels: int, kernel: int,
                      bias: bool = True) -> Tuple["Tensor", Optional["Tensor"]]:
        """(weight (out, in, k, k), bias (out) or None) as nn.Conv2d initialises them."""
        return self._pair(_C.conv2d_params, _b(name), in_channels, out_channels, kernel,
                          int(bias))

    def embedding_params(self, name: str, num: int, dim: int) -> "Tensor":
        """An embedding table (num, dim) initialised as nn.Embedding (normal, std 1)."""
        h = _C.embedding_params(self.handle, _b(name), num, dim)
        if not h:
            raise self.error()
        return Tensor._made(self, h, None)

    def layer_norm_params(self, name: str, dim: int,
                          bias: bool = True) -> Tuple["Tensor", Optional["Tensor"]]:
        """(weight (dim) of ones, bias (dim) of zeros or None) as nn.LayerNorm."""
        return self._pair(_C.layer_norm_params, _b(name), dim, int(bias))

    def params(self) -> List["Tensor"]:
        """The parameters registered so far, in order."""
        return [Tensor._made(self, _C.param_at(self.handle, i), None)
                for i in range(_C.param_count(self.handle))]

    def param_find(self, name: str) -> Optional["Tensor"]:
        """The parameter of that name, or None."""
        h = _C.param_find(self.handle, _b(name))
        return Tensor._made(self, h, None) if h else None


def _dtype_code(dtype):
    d = np.dtype(dtype)
    if d not in _DT_OF:
        raise InvalidArgument(1, "dtype %s: dtrain tensors are float32, int32 or uint8" % d)
    return _DT_OF[d]


def _shape(shape):
    return (ctypes.c_int64 * max(len(shape), 1))(*shape)


# --- 6. tensors -----------------------------------------------------------------------------

class _View:
    """The array interface of C memory, the base of the NumPy array over it.  It keeps
    its owner (a Tensor or Dataset) alive and counted in owner._views: while the count is
    not 0 the owner's free, and its context's dt_ctx_free, wait (owner._view_gone)."""

    def __init__(self, owner, ptr, shape, strides, typestr):
        self._owner = owner
        owner._views += 1
        owner.ctx._views += 1
        self.__array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                    "strides": strides, "version": 3}

    def __del__(self):
        try:
            self._owner._view_gone()
        except Exception:
            pass


class Tensor:
    """dt_tensor.  Step tensors (what ops return) are valid until ctx.step_reset()."""
    __slots__ = ("ctx", "_h", "_life", "_gen", "_owned", "_keep", "_views", "_pin",
                 "__weakref__")

    @classmethod
    def _made(cls, ctx, h, life, owned=False):
        if not h:
            raise ctx.error()
        t = cls.__new__(cls)
        t.ctx = ctx
        t._h = h
        t._life = life
        t._gen = life.gen if life is not None else 0
        t._owned = owned
        t._keep = None
        t._views = 0      # live NumPy views (_View) of its memory
        t._pin = None     # (handle, keep) of a tensor freed while views lived
        return t

    @property
    def handle(self) -> int:
        """The C handle (dt_tensor *); BadState once the tensor is gone."""
        if self._life is not None and self._life.gen != self._gen:
            raise BadState(7, "this tensor is gone: it belonged to a finished step "
                              "(ctx.step_reset), to a loader's earlier batch, or to a loader "
                              "closed since")
        if not self._h or not self.ctx._h:
            raise BadState(7, "this tensor was freed (or its context closed)")
        return self._h

    def free(self) -> None:
        """Free a persistent tensor (parameters stay: they are the context's).  Its memory
        goes at the next step_reset: this step's tape may still read it."""
        if self._owned and self._h and self.ctx._h:
            if self._views:
                self._pin = (self._h, self._keep)   # freed when the last view goes
            else:
                self.ctx._deferred.append((self._h, self._keep))
        self._h = None
        self._keep = None

    def _view_gone(self):
        """A NumPy view of this tensor was collected (_View): a tensor freed while
        views lived is freed with the last (at the next step_reset, as free())."""
        self._views -= 1
        if self._views == 0 and self._pin is not None:
            pin, self._pin = self._pin, None
            if self.ctx._h:
                self.ctx._deferred.append(pin)
            # (a closed context frees it with itself, in Context._view_gone)
        self.ctx._view_gone()

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass

    # shape and contents
    @property
    def shape(self) -> Tuple[int, ...]:
        """The shape, as a tuple."""
        h = self.handle
        return tuple(_C.tensor_dim(h, i) for i in range(_C.tensor_ndim(h)))

    @property
    def ndim(self) -> int:
        """Number of dims."""
        return _C.tensor_ndim(self.handle)

    @property
    def dtype(self) -> Any:
        """The NumPy dtype of the elements (float32, int32, uint8, ...; a bf16 tensor's,
        such as bf16 optimizer state, is uint16: its bits, the top half of a float32)."""
        return np.dtype(_DTYPES[_C.tensor_dtype(self.handle)])

    def numel(self) -> int:
        """Number of elements."""
        return _C.tensor_numel(self.handle)

    @property
    def name(self) -> str:
        """The tensor's name ("" if unnamed); parameters have theirs."""
        return _C.tensor_name(self.handle).decode()

    @name.setter
    def name(self, name: str) -> None:
        self.ctx.check(_C.tensor_set_name(self.handle, _b(name)))

    @property
    def is_contiguous(self) -> bool:
        """Whether the elements are dense in row-major order (views may not be)."""
        return bool(_C.tensor_is_contiguous(self.handle))

    def item(self) -> float:
        """The first element as a float (a scalar loss)."""
        return float(_C.tensor_item(self.handle))

    def numpy(self, copy: bool = False) -> np.ndarray:
        """A NumPy array of the contents.  Of a parameter, a Context.tensor or a
        from_numpy tensor on the CPU backend: a view of its memory, which the view keeps
        alive (past free() and Context.close()).  Of a step tensor, a loader batch, a
        gradient or optimizer state (memory reused or moved), on a device backend, or with
        copy=True: a copy."""
        h = self.handle
        dtype = self.dtype
        shape = self.shape
        # (a borrowed context's memory is the library's to free: copied too)
        if not copy and self._life is None and not self.ctx._borrowed:
            ptr = _C.tensor_data(h)
            if ptr:
                isz = dtype.itemsize
                strides = tuple(_C.tensor_stride(h, i) * isz for i in range(len(shape)))
                return np.asarray(_View(self, ptr, shape, strides, dtype.str))
            _C.clear_error(self.ctx.handle)   # no host memory: copy instead
        out = np.empty(shape, dtype)
        self.ctx.check(_C.tensor_get(h, out.ctypes.data, out.size))
        return out

    def copy_from(self, array: Any) -> None:
        """Copy an array's values in (dt_tensor_set); shapes' sizes must match."""
        a = np.ascontiguousarray(array, dtype=self.dtype)
        self.ctx.check(_C.tensor_set(self.handle, a.ctypes.data, a.size))

    def fill(self, value: float) -> None:
        """Set every element to value."""
        self.ctx.check(_C.tensor_fill(self.handle, value))

    @property
    def grad(self) -> Optional["Tensor"]:
        """The gradient after backward, or None."""
        g = _C.tensor_grad(self.handle)
        # a gradient's memory may move (zero_grad, a DDP's buckets): never viewed, copied
        life = self._life if self._life is not None else self.ctx.persist
        return Tensor._made(self.ctx, g, life) if g else None

    def retain_grad(self) -> None:
        """Keep this op output's gradient through the next backward (as
        torch.Tensor.retain_grad); without it .grad of a non-leaf is None."""
        self.ctx.check(_C.tensor_retain_grad(self.handle))
        return self

    @property
    def requires_grad(self) -> bool:
        """Whether backward computes a gradient for it."""
        return bool(_C.tensor_requires_grad(self.handle))

    @requires_grad.setter
    def requires_grad(self, on: bool) -> None:
        self.ctx.check(_C.tensor_set_requires_grad(self.handle, int(bool(on))))

    def __repr__(self):
        if not self._h or (self._life is not None and self._life.gen != self._gen):
            return "<dtrain.Tensor (gone)>"
        return "<dtrain.Tensor %s %s%s>" % (self.shape, self.dtype,
                                            " " + self.name if self.name else "")

    # operators: ops, recorded on the tape
    # operators, with scalars and NumPy-style broadcasting
    def __add__(self, o): return add(self, _operand(self, o))
    def __radd__(self, o): return add(_operand(self, o), self)
    def __sub__(self, o): return sub(self, _operand(self, o))
    def __rsub__(self, o): return sub(_operand(self, o), self)
    def __mul__(self, o): return scale(self, o) if _is_scalar(o) else mul(self, o)
    def __rmul__(self, o): return self.__mul__(o)
    def __truediv__(self, o): return scale(self, 1.0 / o) if _is_scalar(o) else div(self, o)
    def __rtruediv__(self, o): return div(_operand(self, o), self)
    def __pow__(self, o): return pow(self, o)
    def __matmul__(self, o): return matmul(self, o)
    def __neg__(self): return scale(self, -1.0)


def _is_scalar(o):
    return isinstance(o, (int, float, np.floating, np.integer)) and not isinstance(o, bool)


def _operand(like, o):
    """o as a tensor next to like: a Tensor as it is, a number as a 0-dim step tensor
    (broadcast by the op)."""
    if isinstance(o, Tensor):
        return o
    if not _is_scalar(o):
        raise TypeError("dtrain: a Tensor combines with a Tensor or a number, not %s"
                        % type(o).__name__)
    t = like.ctx.temp((), np.float32)
    t.fill(float(o))
    return t


# --- 7. ops: each returns a step tensor, recorded on the tape -------------------------------

def _op(fn, x, *args):
    ctx = x.ctx
    return Tensor._made(ctx, fn(ctx._h, *args), ctx.step)


def _h(t):
    return None if t is None else t.handle


def reshape(x: "Tensor", shape: Sequence[int]) -> "Tensor":
    """x with another shape of as many elements (a view when x is contiguous)."""
    shape = tuple(shape)
    return _op(_C.reshape, x, x.handle, len(shape), _shape(shape))


def flatten(x: "Tensor", start_dim: int = 1) -> "Tensor":
    """x with its dims from start_dim on merged into one."""
    return _op(_C.flatten, x, x.handle, start_dim)
def transpose(x: "Tensor", d0: int, d1: int) -> "Tensor":
    """x with dims d0 and d1 swapped (a view)."""
    return _op(_C.transpose, x, x.handle, d0, d1)
def slice(x: "Tensor", dim: int, start: int, end: int) -> "Tensor":
    """x's elements start..end-1 along dim (a view)."""
    return _op(_C.slice, x, x.handle, dim, start, end)
def contiguous(x: "Tensor") -> "Tensor":
    """x with its elements dense in row-major order (a copy if they are not)."""
    return _op(_C.contiguous, x, x.handle)


def concat(xs: Sequence["Tensor"], dim: int = 0) -> "Tensor":
    """The tensors joined along dim."""
    hs = (_P * len(xs))(*[t.handle for t in xs])
    return _op(_C.concat, xs[0], hs, len(xs), dim)


def matmul(a: "Tensor", b: "Tensor", trans_a: bool = False, trans_b: bool = False) -> "Tensor":
    """a @ b, with a or b transposed first when asked; batched over leading dims."""
    return _op(_C.matmul, a, a.handle, b.handle, int(trans_a), int(trans_b))


def linear(x: "Tensor", w: "Tensor", b: Optional["Tensor"] = None) -> "Tensor":
    """x (..., in) @ w^T + b over the last dim, as torch.nn.functional.linear (b may be None)."""
    return _op(_C.linear, x, x.handle, w.handle, _h(b))
def add(a: "Tensor", b: "Tensor") -> "Tensor":
    """a + b elementwise, with NumPy broadcasting."""
    return _op(_C.add, a, a.handle, b.handle)
def sub(a: "Tensor", b: "Tensor") -> "Tensor":
    """a - b elementwise, with NumPy broadcasting."""
    return _op(_C.sub, a, a.handle, b.handle)
def mul(a: "Tensor", b: "Tensor") -> "Tensor":
    """a * b elementwise, with NumPy broadcasting."""
    return _op(_C.mul, a, a.handle, b.handle)
def div(a: "Tensor", b: "Tensor") -> "Tensor":
    """a / b elementwise, with NumPy broadcasting."""
    return _op(_C.div, a, a.handle, b.handle)
def scale(x: "Tensor", s: float) -> "Tensor":
    """x * s for a number s."""
    return _op(_C.scale, x, x.handle, s)


def sum(x: "Tensor", dim: Optional[int] = None, keepdim: bool = False) -> "Tensor":
    """The sum of all elements (a scalar), or along dim."""
    if dim is None:
        return _op(_C.sum, x, x.handle)
    return _op(_C.sum_dim, x, x.handle, dim, int(keepdim))


def mean(x: "Tensor", dim: Optional[int] = None, keepdim: bool = False) -> "Tensor":
    """The mean of all elements (a scalar), or along dim."""
    if dim is None:
        return _op(_C.mean, x, x.handle)
    return _op(_C.mean_dim, x, x.handle, dim, int(keepdim))


def relu(x: "Tensor") -> "Tensor":
    """max(x, 0)."""
    return _op(_C.relu, x, x.handle)
def gelu(x: "Tensor") -> "Tensor":
    """GELU (the exact, erf form)."""
    return _op(_C.gelu, x, x.handle)
def gelu_tanh(x: "Tensor") -> "Tensor":
    """GELU, tanh approximation (GPT-2's)."""
    return _op(_C.gelu_tanh, x, x.handle)


def permute(x: "Tensor", *dims: int) -> "Tensor":
    """x with its dims reordered (a view), as torch.permute."""
    d = (_I * len(dims))(*dims)
    return _op(_C.permute, x, x.handle, len(dims), d)


def pow(a: "Tensor", b: Union["Tensor", float]) -> "Tensor":
    """a ** b: b a Tensor (broadcast) or a number."""
    if isinstance(b, Tensor):
        return _op(_C.pow, a, a.handle, b.handle)
    return _op(_C.pow_scalar, a, a.handle, float(b))


def where(cond: "Tensor", a: "Tensor", b: "Tensor") -> "Tensor":
    """cond != 0 ? a : b elementwise, broadcasting the three."""
    return _op(_C.where, a, cond.handle, a.handle, b.handle)
def masked_fill(x: "Tensor", mask: "Tensor", value: float) -> "Tensor":
    """x with value where mask != 0 (mask broadcast to x)."""
    return _op(_C.masked_fill, x, x.handle, mask.handle, float(value))
def exp(x: "Tensor") -> "Tensor":
    """e^x elementwise."""
    return _op(_C.exp, x, x.handle)
def log(x: "Tensor") -> "Tensor":
    """Natural log elementwise."""
    return _op(_C.log, x, x.handle)
def sqrt(x: "Tensor") -> "Tensor":
    """Square root elementwise."""
    return _op(_C.sqrt, x, x.handle)


def attention(q: "Tensor", k: "Tensor", v: "Tensor", mask: Optional["Tensor"] = None,
              causal: bool = False, scale: float = 0.0) -> "Tensor":
    """softmax(scale q k^T + mask) v over (..., T, D), fused (dt_attention)."""
    return _op(_C.attention, q, q.handle, k.handle, v.handle, _h(mask), int(causal), scale)


def cross_entropy_ignore(logits: "Tensor", labels: "Tensor", ignore_index: int = -100) -> "Tensor":
    """Mean cross entropy of logits against labels, skipping labels equal to ignore_index."""
    return _op(_C.cross_entropy_ignore, logits, logits.handle, labels.handle, ignore_index)
def tanh(x: "Tensor") -> "Tensor":
    """tanh elementwise."""
    return _op(_C.tanh, x, x.handle)
def sigmoid(x: "Tensor") -> "Tensor":
    """The logistic sigmoid elementwise."""
    return _op(_C.sigmoid, x, x.handle)
def softmax(x: "Tensor", dim: int = -1) -> "Tensor":
    """Softmax along dim."""
    return _op(_C.softmax, x, x.handle, dim)
def log_softmax(x: "Tensor", dim: int = -1) -> "Tensor":
    """Log-softmax along dim."""
    return _op(_C.log_softmax, x, x.handle, dim)
def cross_entropy(logits: "Tensor", labels: "Tensor") -> "Tensor":
    """Mean cross entropy of (B, C) logits against (B) int32 labels."""
    return _op(_C.cross_entropy, logits, logits.handle, labels.handle)
def mse(pred: "Tensor", target: "Tensor") -> "Tensor":
    """Mean squared error between pred and target."""
    return _op(_C.mse, pred, pred.handle, target.handle)


def conv2d(x: "Tensor", w: "Tensor", b: Optional["Tensor"] = None, stride: int = 1,
           pad: int = 0) -> "Tensor":
    """2-D convolution of (B, C, H, W) x with (O, C, k, k) w and bias b (may be None)."""
    return _op(_C.conv2d, x, x.handle, w.handle, _h(b), stride, pad)


def max_pool2d(x: "Tensor", kernel: int, stride: int = 0, pad: int = 0) -> "Tensor":
    """Max pooling over kernel x kernel windows (stride 0: kernel)."""
    return _op(_C.max_pool2d, x, x.handle, kernel, stride, pad)
def avg_pool2d(x: "Tensor", kernel: int, stride: int = 0, pad: int = 0) -> "Tensor":
    """Average pooling over kernel x kernel windows (stride 0: kernel)."""
    return _op(_C.avg_pool2d, x, x.handle, kernel, stride, pad)
def embedding(weight: "Tensor", idx: "Tensor") -> "Tensor":
    """Rows idx (int32) of the table weight."""
    return _op(_C.embedding, weight, weight.handle, idx.handle)


def layer_norm(x: "Tensor", w: Optional["Tensor"] = None, b: Optional["Tensor"] = None,
               eps: float = 1e-5) -> "Tensor":
    """Layer normalisation over the last dim, then * w + b (either may be None)."""
    return _op(_C.layer_norm, x, x.handle, _h(w), _h(b), eps)


def dropout(x: "Tensor", p: float) -> "Tensor":
    """Dropout with probability p while training (identity otherwise)."""
    return _op(_C.dropout, x, x.handle, p)


def count_correct(logits: "Tensor", labels: "Tensor") -> int:
    """Rows of logits whose argmax equals the label."""
    n = ctypes.c_int64()
    logits.ctx.check(_C.count_correct(logits.ctx._h, logits.handle, labels.handle,
                                      ctypes.byref(n)))
    return n.value


# initialisers (on the context's seeded generator)
def _init(fn, t, *args):
    t.ctx.check(fn(t.ctx._h, t.handle, *args))


def init_uniform(t: "Tensor", lo: float, hi: float) -> None:
    """Fill t uniformly in [lo, hi) from the context's generator."""
    _init(_C.tensor_init_uniform, t, lo, hi)
def init_normal(t: "Tensor", mean: float = 0.0, std: float = 1.0) -> None:
    """Fill t with normal samples (mean, std)."""
    _init(_C.tensor_init_normal, t, mean, std)
def init_kaiming_uniform(t: "Tensor", a: float = 0.0) -> None:
    """Kaiming-uniform init, as torch.nn.init.kaiming_uniform_(t, a)."""
    _init(_C.tensor_init_kaiming_uniform, t, a)
def init_kaiming_normal(t: "Tensor", a: float = 0.0) -> None:
    """Kaiming-normal init, as torch.nn.init.kaiming_normal_(t, a)."""
    _init(_C.tensor_init_kaiming_normal, t, a)
def init_xavier_uniform(t: "Tensor", gain: float = 1.0) -> None:
    """Xavier-uniform init with gain."""
    _init(_C.tensor_init_xavier_uniform, t, gain)
def init_xavier_normal(t: "Tensor", gain: float = 1.0) -> None:
    """Xavier-normal init with gain."""
    _init(_C.tensor_init_xavier_normal, t, gain)
def init_bias(t: "Tensor", fan_in: int) -> None:
    """A bias as torch.nn.Linear/Conv2d initialise it: uniform +-1/sqrt(fan_in)."""
    _init(_C.tensor_init_bias, t, fan_in)


# --- 8. optimizers --------------------------------------------------------------------------

_OPTIMS = {"sgd": 0, "adam": 1, "adamw": 2, "adagrad": 3}
_SCHEDS = {"constant": 0, "step": 1, "cosine": 2}


class _Handle:
    """An object over a C handle that the context outlives: close() frees it (the
    context closes it first when it closes), and so does the garbage collector."""
    _close_order = 1   # the context closes order 0 first (DDPs), 3 last (communicators)
    _what = "object"
    _h = None
    _views = 0          # live NumPy views of its memory (_View): its free waits for them
    _users = 0          # live objects whose C side borrows this one (_borrow): so does it
    _held = ()          # what this one's C side borrows
    _pending = None     # the handle of one closed while views or users lived

    def _own(self, ctx, h):
        self.ctx = ctx
        self._h = h
        if not h:
            raise ctx.error()
        ctx._adopt(self)

    @property
    def handle(self) -> int:
        """The C handle; BadState once closed."""
        if not self._h:
            raise BadState(7, "the %s is closed" % self._what)
        return self._h

    def _borrow(self, *objs):
        """This object's C side reads objs (a loader its dataset, a DDP its communicator
        and optimizer) until it is freed: their close() waits for its free."""
        self._held = tuple(o for o in objs if isinstance(o, _Handle))
        for o in self._held:
            o._users += 1

    def close(self) -> None:
        """Free the C object (the context frees it too when it closes).  While NumPy views
        of its memory, or objects that borrow it (a loader its dataset), live, it is closed
        here (BadState on use) and freed with the last of them."""
        if self._h and self.ctx._h:
            self._pending = self._h
        self._h = None
        self._free_when_unused()

    def _free_when_unused(self):
        if self._pending and not self._views and not self._users:
            h, self._pending = self._pending, None
            self._free(h)
            held, self._held = self._held, ()
            for o in held:   # what it borrowed may go now
                o._users -= 1
                o._free_when_unused()

    def _view_gone(self):
        self._views -= 1
        self._free_when_unused()   # before the context's (it counts this view too)
        self.ctx._view_gone()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_OPTIM_DTYPES = {"f32": 0, "bf16": 3, "f16": 4, "fp16": 4}


_GROUP_KEYS = ("lr", "momentum", "dampening", "weight_decay", "eps", "nesterov")


def _param_groups(groups):
    """[{"params": [...], "weight_decay": 0.0, ...}, ...] as dt_param_group structs, and
    the arrays they point to (to keep until dt_optim_new_groups returns)."""
    out, keep = (dt_param_group * len(groups))(), []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise InvalidArgument(1, "optimizer: parameter group %d is not a dict with "
                                     "'params'" % i)
        ps = list(g["params"])
        arr = (_P * max(len(ps), 1))(*[p.handle for p in ps])
        keep.append(arr)
        _C.param_group_init(ctypes.byref(out[i]), arr, len(ps))
        for k, v in g.items():
            if k == "params":
                continue
            if k == "betas":
                out[i].beta1, out[i].beta2 = v
            elif k in _GROUP_KEYS:
                setattr(out[i], k, int(v) if k == "nesterov" else v)
            else:
                raise InvalidArgument(1, "optimizer: parameter group %d: no setting '%s' (a "
                                         "group sets %s or betas)" % (i, k, ", ".join(_GROUP_KEYS)))
    return out, keep


class ParamGroup:
    """One of Optimizer.param_groups, as torch's dict: g["lr"] reads and sets the group's
    learning rate (a schedule's base too); the other hyper-parameters and "params" read."""

    def __init__(self, opt: "Optimizer", index: int) -> None:
        self._opt, self.index = opt, index

    def _config(self):
        c = dt_optim_config()
        self._opt.ctx.check(_C.optim_group_config(self._opt.handle, self.index, ctypes.byref(c)))
        return c

    def keys(self) -> List[str]:
        """The keys torch's param_groups dicts have."""
        return ["params", "lr", "momentum", "dampening", "nesterov", "weight_decay", "betas", "eps"]

    def __getitem__(self, key: str) -> Any:
        if key == "params":
            h = self._opt.handle
            return [p for p in self._opt.ctx.params() if _C.optim_group_of(h, p.handle) == self.index]
        c = self._config()
        if key == "betas":
            return (c.beta1, c.beta2)
        if key == "nesterov":
            return bool(c.nesterov)
        if key in _GROUP_KEYS:
            return getattr(c, key)
        raise KeyError(key)

    def __setitem__(self, key: str, value: float) -> None:
        if key != "lr":
            raise NotSupported(6, "param_groups: only 'lr' can change after the optimizer is "
                                  "made (make a new one for the others)")
        self._opt.ctx.check(_C.optim_set_group_lr(self._opt.handle, self.index, value))

    def get(self, key: str, default: Any = None) -> Any:
        """self[key], or default for a key it does not have."""
        return self[key] if key in self.keys() else default

    def items(self) -> List[Tuple[str, Any]]:
        """(key, value) pairs, as dict.items()."""
        return [(k, self[k]) for k in self.keys()]

    def __repr__(self) -> str:
        c = self._config()
        return "ParamGroup(%d, lr=%g, weight_decay=%g, %d params)" % (
            self.index, c.lr, c.weight_decay, len(self["params"]))


class Optimizer(_Handle):
    """dt_optim over params (default: every parameter of the context).  kind: sgd, adam,
    adamw, adagrad; keyword arguments are dt_optim_config's fields (lr, momentum, ...,
    betas=(b1, b2)); unset ones keep PyTorch's defaults.  params may be parameter groups
    as torch.optim takes them, [{"params": decay}, {"params": no_decay, "weight_decay": 0}]:
    each group's own lr, momentum, dampening, nesterov, weight_decay, betas or eps, the
    keyword arguments for what it leaves out (dt_optim_new_groups).  param_dtype="bf16" (or "f16"):
    the parameters hold bf16 values and the optimizer f32 master weights (sharded with a
    DDP's zero); state_dtype="bf16": the moments in bf16 (docs/DATA_PARALLEL.md)."""
    _close_order = 1
    _what = "optimizer"
    _free = staticmethod(_C.optim_free)

    def __init__(self, ctx: "Context", kind: str = "adam",
                 params: Optional[Sequence["Tensor"]] = None,
                 betas: Optional[Tuple[float, float]] = None, **cfg: Any) -> None:
        if kind not in _OPTIMS:
            raise InvalidArgument(1, "optimizer kind '%s': one of %s" % (kind, ", ".join(_OPTIMS)))
        c = dt_optim_config()
        _C.optim_config_init(ctypes.byref(c), _OPTIMS[kind])
        for k, v in cfg.items():
            if k not in dict(c._fields_) or k == "struct_size":
                raise InvalidArgument(1, "optimizer: no setting '%s'" % k)
            if k in ("param_dtype", "state_dtype"):
                if v not in _OPTIM_DTYPES:
                    raise InvalidArgument(1, "optimizer: %s is one of %s"
                                          % (k, ", ".join(_OPTIM_DTYPES)))
                v = _OPTIM_DTYPES[v]
            setattr(c, k, v)
        if betas is not None:
            c.beta1, c.beta2 = betas
        if params is not None and any(isinstance(p, dict) for p in params):
            gs, keep = _param_groups(list(params))
            self._own(ctx, _C.optim_new_groups(ctx.handle, ctypes.byref(c), gs, len(gs)))
            del keep
        else:
            hs, n = None, 0
            if params is not None:
                n = len(params)
                hs = (_P * max(n, 1))(*[p.handle for p in params])
            self._own(ctx, _C.optim_new(ctx.handle, ctypes.byref(c), hs, n))
        self._life = _Life()   # of its state tensors: they go when it closes

    def close(self) -> None:
        """Free the optimizer (its state tensors go with it)."""
        super().close()
        if hasattr(self, "_life"):
            self._life.gen += 1

    @property
    def param_groups(self) -> List[ParamGroup]:
        """The parameter groups (one unless made with groups), as torch's param_groups:
        for g in opt.param_groups: g["lr"] = ..."""
        return [ParamGroup(self, i) for i in range(_C.optim_group_count(self.handle))]

    def step(self) -> None:
        """One update from the current gradients."""
        self.ctx.check(_C.optim_step(self.handle))

    def zero_grad(self) -> None:
        """Zero the gradients of this optimizer's parameters."""
        _C.optim_zero_grad(self.handle)

    @property
    def lr(self) -> float:
        """The learning rate (the schedule's, once set); with groups, group 0's, and setting
        it sets every group's (param_groups for one)."""
        return _C.optim_lr(self.handle)

    @lr.setter
    def lr(self, v: float) -> None:
        self.ctx.check(_C.optim_set_lr(self.handle, v))

    @property
    def steps(self) -> int:
        """Steps taken."""
        return _C.optim_steps(self.handle)

    @property
    def state(self) -> List["Tensor"]:
        """The optimizer's state tensors (momentum, exp_avg, exp_avg_sq, ... per
        parameter), named as in checkpoints; they live as long as the optimizer."""
        return [Tensor._made(self.ctx, _C.optim_state_at(self.handle, i), self._life)
                for i in range(_C.optim_state_count(self.handle))]

    def set_schedule(self, kind: str = "cosine", total_steps: int = 0, warmup_steps: int = 0,
                     min_lr: float = 0.0, step_size: int = 0, gamma: float = 0.1) -> None:
        """A learning-rate schedule: "constant", "step" (step_size, gamma) or "cosine"
        (total_steps, min_lr), with a linear warm-up of warmup_steps."""
        s = _schedule_of(kind, total_steps, warmup_steps, min_lr, step_size, gamma)
        self.ctx.check(_C.optim_set_schedule(self.handle, ctypes.byref(s)))


def _schedule_of(kind="cosine", total_steps=0, warmup_steps=0, min_lr=0.0, step_size=0, gamma=0.1):
    """dt_schedule: kind constant, step or cosine (Optimizer.set_schedule's arguments)."""
    if kind not in _SCHEDS:
        raise InvalidArgument(1, "schedule: kind is one of %s" % ", ".join(_SCHEDS))
    return dt_schedule(kind=_SCHEDS[kind], step_size=step_size, gamma=gamma,
                       warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)



_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8", "U8": "u1", "BF16": "<u2"}


def checkpoint_arrays(path: str, optimizer: bool = False) -> Dict[str, np.ndarray]:
    """A checkpoint file's tensors as NumPy arrays, by name, each checked against the
    CRC-32 the file carries; the model's alone unless optimizer (the "optim.*" state).
    No context and no extra package: to load into PyTorch (Debian has no safetensors),
    model.load_state_dict({k: torch.from_numpy(v) for k, v in checkpoint_arrays(p).items()}).
    bf16 tensors come back as float32.  CorruptFile: a damaged file, a checksum that
    does not match; FileError: it cannot be read (a sharded checkpoint is a directory:
    checkpoint_consolidate it first)."""
    import json
    import struct
    import zlib
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise FileError(3, "checkpoint_arrays: cannot read %s: %s" % (path, e.strerror)) from e
    try:
        n = struct.unpack("<Q", raw[:8])[0]
        head = json.loads(raw[8:8 + n].decode("utf-8"))
        meta, body = head.pop("__metadata__", {}), memoryview(raw)[8 + n:]
        out = {}
        for name, t in head.items():
            lo, hi = t["data_offsets"]
            if not 0 <= lo <= hi <= len(body) or t["dtype"] not in _ST_DTYPES:
                raise ValueError("tensor '%s': offsets %s or dtype %s" % (name, (lo, hi), t["dtype"]))
            want = meta.get("dtrain.crc32." + name)
            if want is not None and zlib.crc32(body[lo:hi]) != int(want, 16):
                raise ValueError("tensor '%s' does not match its checksum" % name)
            if name.startswith("optim.") and not optimizer:
                continue
            a = np.frombuffer(body[lo:hi], dtype=_ST_DTYPES[t["dtype"]]).reshape(t["shape"])
            out[name] = ((a.astype(np.uint32) << 16).view(np.float32) if t["dtype"] == "BF16"
                         else a.copy())
        return out
    except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise CorruptFile(4, "checkpoint_arrays: %s: %s" % (path, e)) from e


# --- 9. data --------------------------------------------------------------------------------

# NumPy dtypes a dataset holds as they are (dt_dtype numbers)
_DS_DT = {np.dtype(np.float32): 0, np.dtype(np.int32): 1, np.dtype(np.uint8): 2,
          np.dtype(np.float16): 4}


def _field_of(a):
    """dt_sample_field of one sample of array a (its first dim is the samples)."""
    if a.ndim < 1 or a.ndim > 6:
        raise ValueError("a dataset array needs 1 to 6 dims (the first: samples), got %d" % a.ndim)
    f = dt_sample_field()
    f.dtype = _DS_DT[a.dtype]
    f.ndim = a.ndim - 1
    for d, n in enumerate(a.shape[1:]):
        f.shape[d] = n
    return f


def _dataset_array(a, what):
    """a itself when dtrain can hold it in place (C order, a dtype it reads), else a
    converted copy: float64 -> float32, other ints -> int32."""
    a = np.asarray(a)
    if a.dtype not in _DS_DT:
        if a.dtype.kind == "f":
            a = a.astype(np.float32)
        elif a.dtype.kind in "iub":
            a = a.astype(np.int32)
        else:
            raise TypeError("%s: dtype %s is not a number type" % (what, a.dtype))
    return np.ascontiguousarray(a)


class Dataset(_Handle):
    """dt_dataset: n samples, each an input and a target (section 9 of dtrain.h)."""
    _close_order = 2
    _what = "dataset"
    _free = staticmethod(_C.dataset_free)
    _keep = ()

    def __init__(self, ctx: "Context", handle: int, keep: Any = ()) -> None:
        self._own(ctx, handle)
        self._keep = keep   # arrays and datasets it reads in place: alive as long as it is

    @classmethod
    def from_numpy(cls, ctx: "Context", x: np.ndarray, y: np.ndarray,
                   copy: bool = False) -> "Dataset":
        """Inputs x and targets y (first dim: samples).  Without copy, C-ordered float32,
        int32, uint8 or float16 arrays are used in place (zero copy): do not change them
        while the dataset lives; other arrays are converted once."""
        x, y = _dataset_array(x, "inputs"), _dataset_array(y, "targets")
        if len(x) != len(y):
            raise ValueError("%d inputs but %d targets" % (len(x), len(y)))
        fx, fy = _field_of(x), _field_of(y)
        h = _C.dataset_from_memory(ctx.handle, len(x), ctypes.byref(fx), x.ctypes.data,
                                   ctypes.byref(fy), y.ctypes.data, 1 if copy else 0)
        return cls(ctx, h, () if copy else (x, y))

    @classmethod
    def from_tokens(cls, ctx: "Context", tokens: np.ndarray, context: int = 64,
                    stride: Optional[int] = None, samples: int = 0, seed: int = 0, first: int = 0,
                    count: int = -1) -> "Dataset":
        """Windows of a 1-D token array (uint8, uint16 or int32; used in place) for a
        language model: x the first `context` ids, y the next `context`.  stride None:
        `context`; 0: `samples` random windows from seed."""
        t = np.asarray(tokens)
        if t.dtype not in (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32)):
            t = t.astype(np.int32)
        t = np.ascontiguousarray(t)
        cfg = dt_token_config()
        _C.token_config_init(ctypes.byref(cfg))
        cfg.context, cfg.stride = context, context if stride is None else stride
        cfg.samples, cfg.seed, cfg.first, cfg.count = samples, seed, first, count
        h = _C.dataset_from_tokens(ctx.handle, t.ctypes.data, t.size, t.itemsize, 0,
                                   ctypes.byref(cfg))
        return cls(ctx, h, (t,))

    @classmethod
    def load_npy(cls, ctx: "Context", inputs_path: str, targets_path: str) -> "Dataset":
        """Inputs and targets from NumPy .npy files, memory-mapped and checked against
        their headers."""
        return cls(ctx, _C.dataset_load_npy(ctx.handle, _b(inputs_path), _b(targets_path)))

    @classmethod
    def load_csv(cls, ctx: "Context", path: str, target: Union[int, str] = -1,
                 classify: bool = True, header: int = -1, delimiter: str = ",") -> "Dataset":
        """target: a column name (needs a header) or number (-1: the last)."""
        cfg = dt_csv_config()
        _C.csv_config_init(ctypes.byref(cfg))
        name = _b(target) if isinstance(target, str) else None
        cfg.target_name = name
        if name is None:
            cfg.target_column = target
        cfg.classify, cfg.header, cfg.delimiter = int(classify), header, delimiter.encode()
        return cls(ctx, _C.dataset_load_csv(ctx.handle, _b(path), ctypes.byref(cfg)))

    def subset(self, first: int, count: int) -> "Dataset":
        """Samples [first, first + count) as a dataset (a view of this one)."""
        sub = Dataset(self.ctx, _C.dataset_subset(self.ctx.handle, self.handle, first, count),
                      (self,))
        sub._borrow(self)
        return sub

    def normalize(self, mean: Any = None, std: Any = None, scale_u8: bool = False) -> None:
        """u8 inputs / 255 (scale_u8), then (x - mean) / std per channel, per element or
        overall (as many values as channels, elements or one)."""
        m = np.ascontiguousarray(np.atleast_1d(mean if mean is not None else []), np.float32)
        s = np.ascontiguousarray(np.atleast_1d(std if std is not None else []), np.float32)
        if m.size != s.size:
            raise ValueError("%d means but %d stds" % (m.size, s.size))
        self.ctx.check(_C.dataset_normalize(self.handle, int(scale_u8), m.size,
                                            m.ctypes.data_as(_FP), s.ctypes.data_as(_FP)))

    def stats(self, n: int = 1) -> Tuple[np.ndarray, np.ndarray]:
        """The inputs' (mean, std) arrays per channel (n = channels), element or overall."""
        m, s = np.empty(n, np.float32), np.empty(n, np.float32)
        self.ctx.check(_C.dataset_stats(self.handle, n, m.ctypes.data_as(_FP), s.ctypes.data_as(_FP)))
        return m, s

    @classmethod
    def fashion_mnist(cls, ctx: "Context", split: str = "train",
                      dir: Optional[str] = None) -> "Dataset":
        """Fashion-MNIST as Debian's dataset-fashion-mnist installs it (dir None:
        /usr/share/datasets/fashion-mnist), split "train" (60000) or "test" (10000); the
        .gz files when both are there.  FileError: not found (with the apt-get line)."""
        if split not in ("train", "test"):
            raise InvalidArgument(1, "fashion_mnist: split is \"train\" or \"test\", got %r" % split)
        d = dir or "/usr/share/datasets/fashion-mnist"
        pre = "train" if split == "train" else "t10k"
        def path(name):
            p = os.path.join(d, "%s-%s.gz" % (pre, name))
            return p if os.access(p, os.R_OK) else os.path.join(d, "%s-%s" % (pre, name))
        images, labels = path("images-idx3-ubyte"), path("labels-idx1-ubyte")
        if not os.access(images, os.R_OK):
            raise FileError(3, "fashion_mnist: Fashion-MNIST not found in %s (install Debian's "
                            "dataset-fashion-mnist: apt-get install dataset-fashion-mnist)" % d)
        return cls.load_idx(ctx, images, labels)

    @classmethod
    def load_idx(cls, ctx: "Context", images_path: str, labels_path: str) -> "Dataset":
        """Images and labels from IDX files (gzip or plain), as MNIST ships them."""
        return cls(ctx, _C.dataset_load_idx(ctx.handle, _b(images_path), _b(labels_path)))

    def __len__(self):
        return _C.dataset_size(self.handle)

    @property
    def sample_shape(self) -> Tuple[int, ...]:
        """One input's shape, without the sample dim."""
        s = (ctypes.c_int64 * 6)()
        n = _C.dataset_sample_shape(self.handle, s)
        return tuple(s[:n])

    @property
    def classes(self) -> int:
        """The number of classes of integer labels (0 for other targets)."""
        return _C.dataset_classes(self.handle)

    def image(self, i: int) -> np.ndarray:
        """Sample i's pixels, a read-only uint8 view of the dataset's memory."""
        if not 0 <= i < len(self):
            raise IndexError("sample %d of %d" % (i, len(self)))
        shape = self.sample_shape
        a = np.asarray(_View(self, _C.dataset_image(self.handle, i), shape, None, "|u1"))
        a.flags.writeable = False
        return a

    def label(self, i: int) -> int:
        """Sample i's integer label."""
        if not 0 <= i < len(self):
            raise IndexError("sample %d of %d" % (i, len(self)))
        return _C.dataset_label(self.handle, i)



class Loader(_Handle):
    """dt_loader: batches x (B,C,H,W) float32 and y (B) int32.  Keyword arguments are
    dt_loader_config's fields (batch, shuffle, seed, mean, std, prefetch, shard_rank,
    shard_count, ...).  A batch's tensors are valid until the next batch."""
    _close_order = 1
    _what = "loader"
    _free = staticmethod(_C.loader_free)

    def __init__(self, ctx: "Context", dataset: "Dataset", **cfg: Any) -> None:
        c = dt_loader_config()
        _C.loader_config_init(ctypes.byref(c))
        for k, v in cfg.items():
            if k not in dict(c._fields_) or k == "struct_size":
                raise InvalidArgument(1, "loader: no setting '%s'" % k)
            setattr(c, k, int(v) if isinstance(v, bool) else v)
        self.dataset = dataset   # borrowed by C: kept alive here
        self.batch_life = _Life()
        self._x, self._y = _P(), _P()
        self._own(ctx, _C.loader_new(ctx.handle, dataset.handle, ctypes.byref(c)))
        self._borrow(dataset)

    def __len__(self):
        """Batches per epoch."""
        return _C.loader_batches(self.handle)

    def start_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: its order comes from the seed and the epoch."""
        self.batch_life.gen += 1
        self.ctx.check(_C.loader_start_epoch(self.handle, epoch))

    def next(self) -> Optional[Tuple["Tensor", "Tensor"]]:
        """The next batch (x, y), or None at the end of the epoch."""
        self.batch_life.gen += 1
        st = _C.loader_next(self.handle, ctypes.byref(self._x), ctypes.byref(self._y))
        if st == _EOF:
            return None
        self.ctx.check(st)
        ctx, life = self.ctx, self.batch_life
        x, y = Tensor._made(ctx, self._x.value, life), Tensor._made(ctx, self._y.value, life)
        x._keep = y._keep = self   # a batch keeps its loader: next(iter(Loader(...))) works
        return x, y

    def epoch(self, epoch: int) -> Iterator[Tuple["Tensor", "Tensor"]]:
        """Iterate over one epoch's batches."""
        self.start_epoch(epoch)
        while True:
            b = self.next()
            if b is None:
                return
            yield b

    @property
    def wait_seconds(self) -> float:
        """Seconds the caller waited for batches since the epoch started."""
        return _C.loader_wait_seconds(self.handle)

    def close(self) -> None:
        """Free the loader (its batches go with it)."""
        super().close()
        self.batch_life.gen += 1


# --- 10. processes: launcher environment, communicator, DDP ---------------------------------

DistEnv = namedtuple("DistEnv", "rank world_size local_rank local_world_size master_addr "
                                "master_port launcher")


def dist_env(ctx: "Context") -> "DistEnv":
    """Where this process sits in its job, from the launcher's environment (dtrun,
    torchrun, mpirun, srun); a single process is rank 0 of 1."""
    e = dt_dist_env()
    ctx.check(_C.dist_env_detect(ctx.handle, ctypes.byref(e)))
    return DistEnv(e.rank, e.world_size, e.local_rank, e.local_world_size,
                   e.master_addr.decode(), e.master_port, (e.launcher or b"").decode())


_REDUCE = {"sum": 0, "avg": 1, "max": 2, "min": 3}


def _f32_buffer(a, what):
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous
            and a.flags.writeable):
        raise InvalidArgument(1, "%s: needs a writeable C-contiguous float32 array" % what)
    return a.ctypes.data


class Comm(_Handle):
    """dt_comm: every rank of the job started by a launcher (collective: every rank makes
    one).  transport: shm, tcp, verbs or None (shm on one host, else tcp).  timeout_ms:
    liveness (a peer whose heartbeat stops this long is gone; 0: DTRAIN_TIMEOUT_MS, else
    30 s); collective_timeout_ms: how long a collective waits for a living peer (0:
    DTRAIN_COLLECTIVE_TIMEOUT_MS, else 10 minutes)."""
    _close_order = 3
    _what = "communicator"
    _free = staticmethod(_C.comm_free)

    def __init__(self, ctx: "Context", transport: Optional[str] = None,
                 timeout_ms: int = 0, collective_timeout_ms: int = 0) -> None:
        c = dt_comm_config()
        _C.comm_config_init(ctypes.byref(c))
        c.transport = _b(transport)
        c.timeout_ms = timeout_ms
        c.collective_timeout_ms = collective_timeout_ms
        self._own(ctx, _C.comm_new(ctx.handle, None, ctypes.byref(c)))

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return _C.comm_rank(self.handle)

    @property
    def size(self) -> int:
        """The number of ranks."""
        return _C.comm_size(self.handle)

    @property
    def transport(self) -> str:
        """The transport in use ("shm", "tcp", ...)."""
        return _C.comm_transport(self.handle).decode()

    def allreduce(self, array: np.ndarray, op: str = "sum") -> None:
        """In place on a float32 array (its memory is the buffer: no copy)."""
        self.ctx.check(_C.comm_allreduce(self.handle, _f32_buffer(array, "allreduce"), array.size,
                                    _REDUCE[op]))
        return array

    def broadcast(self, array: np.ndarray, root: int = 0) -> None:
        """Rank root's array to every rank, in place (float32)."""
        self.ctx.check(_C.comm_broadcast(self.handle, _f32_buffer(array, "broadcast"), array.size,
                                    root))
        return array

    def allgather(self, array: np.ndarray) -> np.ndarray:
        """Every rank's array, stacked in rank order: shape (size, *array.shape)."""
        a = np.ascontiguousarray(array, dtype=np.float32)
        out = np.empty((self.size,) + a.shape, np.float32)
        self.ctx.check(_C.comm_allgather(self.handle, a.ctypes.data, a.size, out.ctypes.data))
        return out

    def barrier(self) -> None:
        """Wait until every rank has reached it."""
        self.ctx.check(_C.comm_barrier(self.handle))

    # point to point: float32 arrays, borrowed for the call
    def send(self, array: np.ndarray, dst: int) -> None:
        """Send a float32 array to rank dst (pipelines: activations forward, gradients back)."""
        a = np.ascontiguousarray(array, dtype=np.float32)
        self.ctx.check(_C.comm_send(self.handle, a.ctypes.data, a.size, dst))

    def recv(self, array: np.ndarray, src: int) -> None:
        """Into a float32 array in place; the sender must send exactly array.size floats."""
        self.ctx.check(_C.comm_recv(self.handle, _f32_buffer(array, "recv"), array.size, src))
        return array

    def sendrecv(self, send: np.ndarray, dst: int, recv: np.ndarray, src: int) -> None:
        """Send to dst and receive from src at once (no deadlock between neighbours)."""
        a = np.ascontiguousarray(send, dtype=np.float32)
        self.ctx.check(_C.comm_sendrecv(self.handle, a.ctypes.data, a.size, dst,
                                   _f32_buffer(recv, "sendrecv"), recv.size, src))
        return recv

    def split(self, color: int, key: int = 0) -> "Group":
        """dt_comm_split (collective): the ranks passing the same color form a Group,
        ranked by key then rank.  Close it (or the context) before this communicator."""
        return Group(self, color, key)

    def job_rank(self, rank: int) -> int:
        """The rank in the whole job of this communicator's rank `rank`."""
        return _C.comm_job_rank(self.handle, rank)


class Group(Comm):
    """A process group from Comm.split: a whole communicator over some of the ranks."""
    _close_order = 2
    _what = "process group"

    def __init__(self, parent: "Comm", color: int, key: int) -> None:
        c = dt_comm_config()
        _C.comm_config_init(ctypes.byref(c))
        self.parent = parent
        self._own(parent.ctx, _C.comm_split(parent.handle, color, key, ctypes.byref(c)))



_COMPRESS = {"auto": -1, "none": 0, "bf16": 1, "fp16": 2, "topk": 3, "int8": 4}


class DDP(_Handle):
    """dt_ddp: data parallelism over comm for every parameter of ctx (collective).  rank
    0's parameters go to every rank; backward starts the bucketed allreduces; step() waits,
    averages and steps opt.  Keyword arguments: dt_ddp_config's fields (bucket_bytes,
    overlap, compress="bf16", zero=1 or 2 to shard the optimizer state and gradients, ...)."""
    _close_order = 0
    _what = "DDP"
    _free = staticmethod(_C.ddp_free)

    def __init__(self, ctx: "Context", comm: "Comm", opt: Optional["Optimizer"] = None,
                 compress: str = "auto", ps: Optional["ParameterServer"] = None,
                 **cfg: Any) -> None:
        c = dt_ddp_config()
        _C.ddp_config_init(ctypes.byref(c))
        c.compress = _COMPRESS[compress]   # "auto": DTRAIN_COMPRESS, else none
        for k, v in cfg.items():
            if k not in dict(c._fields_) or k in ("ps", "struct_size"):
                raise InvalidArgument(1, "ddp: no setting '%s'" % k)
            setattr(c, k, v)
        c.ps = ps.handle if ps is not None else None   # buckets go to the parameter servers
        self.comm, self.opt, self.ps = comm, opt, ps   # borrowed by C: kept alive here
        self._own(ctx, _C.ddp_new(ctx.handle, comm.handle, opt.handle if opt else None,
                                  ctypes.byref(c)))
        self._borrow(comm, opt, ps)

    def sync(self) -> None:
        """Wait until every bucket of this step is reduced."""
        self.ctx.check(_C.ddp_sync(self.handle))

    def step(self) -> None:
        """sync(), then the optimizer's step."""
        self.ctx.check(_C.ddp_step(self.handle))

    def set_sync(self, on: bool) -> None:
        """False: backward only accumulates locally (PyTorch's no_sync())."""
        self.ctx.check(_C.ddp_set_sync(self.handle, int(bool(on))))

    def full_params(self) -> None:
        """zero=3: every parameter whole on every rank until the next optimizer step (to
        read, evaluate or save them); collective.  Other levels: nothing to do."""
        self.ctx.check(_C.ddp_full_params(self.handle))

    def checkpoint_save(self, directory: str, opt: Optional["Optimizer"] = None,
                        step: int = 0) -> None:
        """A sharded checkpoint: each rank writes its shard of the parameters and of opt's
        state into directory, then rank 0 the index; any zero level.  Collective."""
        self.ctx.check(_C.ddp_checkpoint_save(self.handle, opt.handle if opt else None,
                                              _b(directory), step))

    def checkpoint_load(self, directory: str, opt: Optional["Optimizer"] = None) -> int:
        """Resume from a sharded checkpoint saved at any world size and zero level (every
        shard checked on every rank before anything is copied); its step.  Collective."""
        step = _I64()
        self.ctx.check(_C.ddp_checkpoint_load(self.handle, opt.handle if opt else None,
                                              _b(directory), ctypes.byref(step)))
        return step.value

    def stats(self, reset: bool = False) -> Dict[str, Any]:
        """Totals since the DDP began or the last reset: buckets, bytes, backward,
        communication and exposed time."""
        s = dt_ddp_stats()
        self.ctx.check(_C.ddp_stats_get(self.handle, ctypes.byref(s)))
        if reset:
            _C.ddp_stats_reset(self.handle)
        return {f: getattr(s, f) for f, _ in s._fields_}



_SCHEDULES = {"gpipe": 0, "1f1b": 1}


class Pipe(_Handle):
    """dt_pipe: this rank's stage of a pipeline over comm's ranks (stage = comm.rank).
    stage(x, y) runs one micro-batch: x its input (stage 0: rows of step's x; later: the
    previous stage's output), y the targets' rows on the last stage (else None); it
    returns the stage's output, or the micro-batch's mean loss on the last stage.  The
    tensors given to it are valid only during step()."""
    _close_order = 1
    _what = "pipeline"
    _free = staticmethod(_C.pipe_free)

    def __init__(self, ctx: "Context", comm: "Comm",
                 stage: Callable[["Tensor", Optional["Tensor"]], "Tensor"], micro_batches: int = 4,
                 schedule: str = "1f1b") -> None:
        c = dt_pipe_config()
        _C.pipe_config_init(ctypes.byref(c))
        c.micro_batches = micro_batches
        if schedule not in _SCHEDULES:
            raise InvalidArgument(1, "pipe: schedule is 'gpipe' or '1f1b', not %r" % schedule)
        c.schedule = _SCHEDULES[schedule]
        self.comm, self._stage, self._failure = comm, stage, []
        self._life = _Life()
        self._cb = _STAGE_FN(self._trampoline)   # kept alive as long as C may call it
        self._own(ctx, _C.pipe_new(ctx.handle, comm.handle, ctypes.byref(c), self._cb, None))
        self._borrow(comm)

    def _trampoline(self, ctx_h, x_h, y_h, user):
        try:
            x = Tensor._made(self.ctx, x_h, self._life)
            y = Tensor._made(self.ctx, y_h, self._life) if y_h else None
            return self._stage(x, y).handle
        except BaseException as e:   # raised after step returns; the step fails
            self._failure.append(e)
            return None

    @property
    def stage(self) -> int:
        """This rank's stage."""
        return _C.pipe_stage(self.handle)

    @property
    def stages(self) -> int:
        """The number of stages."""
        return _C.pipe_stages(self.handle)

    def step(self, x: Optional["Tensor"] = None, y: Optional["Tensor"] = None) -> Optional[float]:
        """One step's forward and backward (collective over the pipeline): x on stage 0,
        y on the last stage.  Returns the batch's mean loss on the last stage, else None."""
        loss = _F(0.0)
        st = _C.pipe_step(self.handle, _h(x), _h(y), ctypes.byref(loss))
        self._life.gen += 1
        if self._failure:
            e, self._failure = self._failure[0], []
            raise e
        self.ctx.check(st)
        return None if math.isnan(loss.value) else loss.value

    def stats(self, reset: bool = False) -> Dict[str, Any]:
        """Totals since the pipeline began or the last reset: compute, wait, the bubble."""
        s = dt_pipe_stats()
        self.ctx.check(_C.pipe_stats_get(self.handle, ctypes.byref(s)))
        if reset:
            _C.pipe_stats_reset(self.handle)
        return {f: getattr(s, f) for f, _ in s._fields_}


_LAYER_FN = ctypes.CFUNCTYPE(_P, _P, _P, _P)


def layer_times(ctx: "Context", layers: Sequence[Callable[["Tensor"], "Tensor"]], sample: "Tensor",
                reps: int = 5, comm: Optional["Comm"] = None) -> List[float]:
    """dt_profile_layer_times: each layer(x) -> y of a sequential model timed forward and backward
    alone, in ms (averaged over comm's ranks when given).  Leaves gradients zeroed."""
    n = len(layers)
    failure = []
    life = _Life()

    def make(fn):
        def trampoline(ctx_h, x_h, user):
            try:
                return fn(Tensor._made(ctx, x_h, life)).handle
            except BaseException as e:
                failure.append(e)
                return None
        return _LAYER_FN(trampoline)

    cbs = [make(fn) for fn in layers]
    fns = (_LAYER_FN * n)(*cbs)
    out = (_D * n)()
    st = _C.profile_layer_times(ctx.handle, comm.handle if comm else None, fns, None, n,
                        sample.handle, reps, out)
    life.gen += 1
    ctx._step_ended()
    if failure:
        raise failure[0]
    ctx.check(st)
    return list(out)


def pipe_partition(costs: Sequence[float], stages: int) -> List[int]:
    """dt_pipe_partition: the first layer of each stage (stages + 1 entries, the last
    len(costs)), minimising the largest stage's total cost."""
    n = len(costs)
    first = (_I * (stages + 1))()
    st = _C.pipe_partition((_D * max(n, 1))(*costs), n, stages, first)
    if st:
        raise _error(st, "pipe_partition: needs stages >= 1, at least as many layers, and "
                         "finite costs >= 0")
    return list(first)


# tensor parallelism: ops over the ranks of comm (collectives: every rank runs them alike)
def tp_copy(comm: "Comm", x: "Tensor") -> "Tensor":
    """Tensor parallelism's f: identity forward, allreduce of the gradient backward."""
    return _op(_C.tp_copy, x, comm.handle, x.handle)
def tp_reduce(comm: "Comm", x: "Tensor") -> "Tensor":
    """Tensor parallelism's g: allreduce forward, identity backward."""
    return _op(_C.tp_reduce, x, comm.handle, x.handle)
def tp_gather(comm: "Comm", x: "Tensor") -> "Tensor":
    """Gather the ranks' last-dim shards of x forward; split the gradient backward."""
    return _op(_C.tp_gather, x, comm.handle, x.handle)
def tp_split(comm: "Comm", x: "Tensor") -> "Tensor":
    """This rank's last-dim shard of x forward; gather the gradient backward."""
    return _op(_C.tp_split, x, comm.handle, x.handle)


def tp_linear_col(comm: "Comm", x: "Tensor", w: "Tensor", b: Optional["Tensor"] = None,
                  gather_output: bool = False) -> "Tensor":
    """A column-parallel linear layer: this rank holds a slice of the output features."""
    return _op(_C.tp_linear_col, x, comm.handle, x.handle, w.handle, _h(b), int(gather_output))


def tp_linear_row(comm: "Comm", x: "Tensor", w: "Tensor", b: Optional["Tensor"] = None,
                  input_is_split: bool = False) -> "Tensor":
    """A row-parallel linear layer: this rank holds a slice of the input features; the
    outputs are summed."""
    return _op(_C.tp_linear_row, x, comm.handle, x.handle, w.handle, _h(b), int(input_is_split))


def tp_shard(comm: "Comm", full: "Tensor", dim: int, shard: "Tensor") -> None:
    """Copy this rank's block of full along dim into shard (local)."""
    shard.ctx.check(_C.tp_shard(comm.handle, full.handle, dim, shard.handle))


# --- 11. evaluation and the profiler --------------------------------------------------------

Metrics = namedtuple("Metrics", "samples correct accuracy loss value")
_METRICS = {"classify": 0, "loss": 1}


def evaluate(ctx: "Context", dataset: "Dataset", forward: Callable[["Tensor"], "Tensor"],
             comm: Optional["Comm"] = None, batch: int = 128, mean: float = 0.0, std: float = 1.0,
             metric: str = "classify") -> "Metrics":
    """dt_evaluate: forward(x) -> logits over the whole dataset, grad and training off;
    with comm, split over the ranks (collective) and combined.  metric: "classify"
    (accuracy and mean cross entropy) or "loss" (the mean loss per target element).
    Returns Metrics."""
    cfg = dt_eval_config()
    _C.eval_config_init(ctypes.byref(cfg))
    if metric not in _METRICS:
        raise InvalidArgument(1, "evaluate: metric is one of %s" % ", ".join(_METRICS))
    cfg.batch, cfg.mean, cfg.std, cfg.metric = batch, mean, std, _METRICS[metric]
    failure = []
    call_life = _Life()

    def trampoline(ctx_h, x_h, user):
        try:
            y = forward(Tensor._made(ctx, x_h, call_life))
            return y.handle
        except BaseException as e:   # said after dt_evaluate returns
            failure.append(e)
            return None

    cb = _FORWARD_FN(trampoline)
    out = dt_metrics()
    st = _C.evaluate(ctx.handle, comm.handle if comm else None, dataset.handle,
                     ctypes.byref(cfg), cb, None, ctypes.byref(out))
    call_life.gen += 1
    ctx._step_ended()   # dt_evaluate resets the step arena between batches
    if failure:
        raise failure[0]
    ctx.check(st)
    return Metrics(out.samples, out.correct, out.accuracy, out.loss, out.value)


def profile_start(ctx: "Context", max_events: int = 0, straggler_threshold: float = 0.0,
                  check_every: int = 0) -> None:
    """Start (or restart) profiling ctx; the report comes from profile_finish."""
    c = dt_profile_config()
    _C.profile_config_init(ctypes.byref(c))
    c.max_events, c.straggler_threshold = max_events, straggler_threshold
    c.check_every = check_every
    ctx.check(_C.profile_start(ctx.handle, ctypes.byref(c)))


def profile_stats(ctx: "Context") -> Dict[str, Any]:
    """This rank's profile totals so far, as a dict."""
    s = dt_profile_stats()
    ctx.check(_C.profile_stats_get(ctx.handle, ctypes.byref(s)))
    return {f: getattr(s, f) for f, _ in s._fields_}


def profile_finish(ctx: "Context", comm: Optional["Comm"] = None,
                   trace_path: Optional[str] = None) -> str:
    """Collective: the timeline to trace_path (rank 0) and the report; rank 0 gets the
    report's text, other ranks ""."""
    ctx.check(_C.profile_stop(ctx.handle, comm.handle if comm else None, _b(trace_path)))
    return _C.profile_report(ctx.handle).decode()


def profile_rank_stats(ctx: "Context", rank: int) -> Dict[str, Any]:
    """Rank `rank`'s totals as gathered by profile_finish (rank 0, after it), as a dict."""
    s = dt_profile_stats()
    ctx.check(_C.profile_rank_stats_get(ctx.handle, rank, ctypes.byref(s)))
    return {f: getattr(s, f) for f, _ in s._fields_}


# --- 12. the library's version, dtypes, mixed precision, your own ops ------------------------

def version() -> Tuple[int, int, int]:
    """The library's version as (major, minor, patch) (dt_version)."""
    v = _version()
    return (v // 10000, v // 100 % 100, v % 100)


def version_string() -> str:
    """The library's version as text, e.g. "0.1.0" (dt_version_string)."""
    return _C.version_string().decode()


_DTYPE_NAMES = {"f32": 0, "i32": 1, "u8": 2, "bf16": 3, "f16": 4}


def dtype_name(code: int) -> str:
    """The name of dt_dtype `code` ("f32", "i32", ...; "?" for none)."""
    return _C.dtype_name(code).decode()


def dtype_size(code: int) -> int:
    """Bytes per element of dt_dtype `code` (0 for none)."""
    return _C.dtype_size(code)


_PRECISIONS = {"f32": 0, "fp32": 0, "tf32": 1, "bf16": 2, "fp16": 3, "f16": 3}
_PRECISION_NAMES = {0: "f32", 1: "tf32", 2: "bf16", 3: "fp16"}


class _Scoped:
    """A with-block that sets a context's state and puts the old one back."""

    def __init__(self, enter: Callable[[], Any], leave: Callable[[Any], None]) -> None:
        self._enter, self._leave = enter, leave

    def __enter__(self):
        self._old = self._enter()
        return self

    def __exit__(self, *exc):
        self._leave(self._old)


def _keep_for_step(ctx, *objs):
    """Keep callbacks C may call until the step's tape is gone (step_reset)."""
    ctx._deferred.append((None, objs))


def custom_op(name: str, inputs: Sequence["Tensor"], forward: Callable[[List["Tensor"]], "Tensor"],
              backward: Callable[[List["Tensor"], "Tensor", "Tensor"],
                                 Sequence[Optional["Tensor"]]]) -> "Tensor":
    """Your own op with its own backward (as torch.autograd.Function; dt_custom_op).
    forward(inputs) -> Tensor, run with gradients off, returns a new tensor (ops, or
    ctx.temp(...) filled with copy_from); backward(inputs, out, dout) -> a gradient per
    input (a Tensor of its shape, or None), run with gradients off during ctx.backward.
    1 to 3 inputs.  Exceptions in either come out of custom_op or ctx.backward."""
    inputs = list(inputs)
    ctx = inputs[0].ctx
    failure = []
    life = _Life()   # the tensors given to the callbacks: valid during the call only

    def wrap(hs, n):
        return [Tensor._made(ctx, hs[i], life) for i in range(n)]

    def fwd(ctx_h, hs, n, user):
        try:
            return forward(wrap(hs, n)).handle
        except BaseException as e:
            failure.append(e)
            return None
        finally:
            life.gen += 1

    def bwd(ctx_h, hs, n, out_h, dout_h, grads, user):
        try:
            gs = backward(wrap(hs, n), Tensor._made(ctx, out_h, life),
                          Tensor._made(ctx, dout_h, life))
            if len(gs) != n:
                raise ValueError("custom_op %s: backward gave %d gradients for %d inputs"
                                 % (name, len(gs), n))
            for i, g in enumerate(gs):
                grads[i] = None if g is None else g.handle
            return 0
        except BaseException as e:
            ctx._backward_failure.append(e)
            return 1
        finally:
            life.gen += 1

    cf, cb = _CUSTOM_FWD(fwd), _CUSTOM_BWD(bwd)
    arr = (_P * len(inputs))(*[t.handle for t in inputs])
    h = _C.custom_op(ctx.handle, _b(name), arr, len(inputs), cf, cb, None)
    if failure:
        raise failure[0]
    out = Tensor._made(ctx, h, ctx.step)
    _keep_for_step(ctx, cf, cb, forward, backward)
    return out


def recompute(fn: Callable[..., "Tensor"], *inputs: "Tensor") -> "Tensor":
    """Activation checkpointing (dt_recompute): out = fn(*inputs), its intermediate
    tensors not kept; ctx.backward runs fn again to rebuild them.  fn must be
    deterministic and return one tensor."""
    ctx = inputs[0].ctx
    failure = []
    life = _Life()

    def seg(ctx_h, hs, n, user):
        try:
            return fn(*[Tensor._made(ctx, hs[i], life) for i in range(n)]).handle
        except BaseException as e:
            (failure if not ctx._in_backward else ctx._backward_failure).append(e)
            return None

    cf = _SEGMENT_FN(seg)
    arr = (_P * len(inputs))(*[t.handle for t in inputs])
    h = _C.recompute(ctx.handle, cf, arr, len(inputs), None)
    if failure:
        raise failure[0]
    out = Tensor._made(ctx, h, ctx.step)
    _keep_for_step(ctx, cf, fn, life, inputs)
    return out


class LossScaler(_Handle):
    """Dynamic loss scaling for fp16 (torch.cuda.amp.GradScaler; dt_loss_scaler)."""
    _close_order = 1
    _what = "loss scaler"
    _free = staticmethod(_C.loss_scaler_free)

    def __init__(self, ctx: "Context", init_scale: float = 65536.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        c = dt_loss_scale_config()
        _C.loss_scale_config_init(ctypes.byref(c))
        c.init_scale, c.growth_factor = init_scale, growth_factor
        c.backoff_factor, c.growth_interval = backoff_factor, growth_interval
        self._own(ctx, _C.loss_scaler_new(ctx.handle, ctypes.byref(c)))

    def backward(self, loss: "Tensor") -> None:
        """ctx.backward with the loss scaled."""
        self.ctx._run_backward(lambda: _C.loss_scaler_backward(self.handle, loss.handle))

    def unscale(self) -> bool:
        """Divide the gradients by the scale; True if one is inf or NaN."""
        found = _I()
        self.ctx.check(_C.loss_scaler_unscale(self.handle, ctypes.byref(found)))
        return bool(found.value)

    def step(self, opt: "Optimizer") -> bool:
        """opt.step() unless a gradient overflowed; updates the scale.  True if stepped."""
        stepped = _I()
        self.ctx.check(_C.loss_scaler_step(self.handle, opt.handle, ctypes.byref(stepped)))
        return bool(stepped.value)

    @property
    def scale(self) -> float:
        """The loss scale now."""
        return _C.loss_scaler_scale(self.handle)

    @property
    def skipped(self) -> int:
        """Steps skipped for overflow so far."""
        return _C.loss_scaler_skipped(self.handle)


# --- 13. checkpoints with options ----------------------------------------------------------

_SAVE_DTYPES = {"f32": 0, "bf16": 3, "f16": 4}


def checkpoint_save(ctx: "Context", path: str, opt: Optional["Optimizer"] = None, step: int = 0,
                    dtype: str = "f32", metadata: Optional[Dict[str, str]] = None) -> None:
    """Parameters, opt's state and the step to path (safetensors, written atomically), the
    parameters stored as dtype ("f32", "bf16", "f16"), with your own metadata (a dict of
    str -> str, read back with checkpoint_metadata)."""
    c = dt_checkpoint_config()
    _C.checkpoint_config_init(ctypes.byref(c))
    if dtype not in _SAVE_DTYPES:
        raise InvalidArgument(1, "checkpoint_save: dtype is one of %s" % ", ".join(_SAVE_DTYPES))
    c.dtype = _SAVE_DTYPES[dtype]
    meta = dict(metadata or {})
    keys = (_S * max(len(meta), 1))(*[_b(k) for k in meta])
    vals = (_S * max(len(meta), 1))(*[_b(v) for v in meta.values()])
    c.n_meta, c.meta_keys, c.meta_values = len(meta), keys, vals
    ctx.check(_C.checkpoint_save(ctx.handle, opt.handle if opt else None, _b(path), step,
                                 ctypes.byref(c)))


CheckpointReport = namedtuple("CheckpointReport", "step loaded missing unexpected mismatched names")


def checkpoint_load(ctx: "Context", path: str, opt: Optional["Optimizer"] = None,
                    strict: bool = True) -> Any:
    """Load a checkpoint (checked whole first: a bad file changes nothing) and return its
    step.  path may be a sharded checkpoint's directory (DDP.checkpoint_save): loaded
    whole.  strict=False loads every parameter the file has with its shape and leaves the
    others (fine-tuning; no optimizer), and returns a CheckpointReport instead (step,
    counts, and the names of those missing, unexpected or mismatched)."""
    c = dt_checkpoint_config()
    _C.checkpoint_config_init(ctypes.byref(c))
    c.strict = int(bool(strict))
    step, rep = _I64(), dt_checkpoint_report()
    ctx.check(_C.checkpoint_load(ctx.handle, opt.handle if opt else None, _b(path),
                                 ctypes.byref(c), ctypes.byref(step), ctypes.byref(rep)))
    if strict:
        return step.value
    return CheckpointReport(step.value, rep.loaded, rep.missing, rep.unexpected, rep.mismatched,
                            rep.names.decode(errors="replace"))


def checkpoint_latest(ctx: "Context", directory: str) -> Optional[Tuple[str, int]]:
    """(path, step) of the newest complete checkpoint in directory, or None."""
    buf, step = ctypes.create_string_buffer(4096), _I64()
    ctx.check(_C.checkpoint_latest(ctx.handle, _b(directory), buf, len(buf), ctypes.byref(step)))
    return (buf.value.decode(), step.value) if buf.value else None


def checkpoint_consolidate(ctx: "Context", directory: str, path: str) -> None:
    """A sharded checkpoint's directory written as one safetensors file (what
    checkpoint_save writes in one process; PyTorch's safetensors reader reads it)."""
    ctx.check(_C.checkpoint_consolidate(ctx.handle, _b(directory), _b(path)))


def checkpoint_metadata(ctx: "Context", path: str, key: str) -> str:
    """The value of metadata key in the checkpoint at path (the file is checked whole)."""
    buf = ctypes.create_string_buffer(1 << 16)
    ctx.check(_C.checkpoint_metadata(ctx.handle, _b(path), _b(key), buf, len(buf)))
    return buf.value.decode()


# --- 14. more data: raw files, tokens, your own samples, a sample's arrays ------------------

_NP_OF = {0: np.float32, 1: np.int32, 2: np.uint8, 3: np.uint16, 4: np.float16}


def _field(shape, dtype):
    f = dt_sample_field()
    d = np.dtype(dtype)
    if d not in _DS_DT:
        raise InvalidArgument(1, "a dataset field is float32, int32, uint8 or float16, not %s" % d)
    f.dtype, f.ndim = _DS_DT[d], len(shape)
    for i, n in enumerate(shape):
        f.shape[i] = n
    return f


def _field_shape(f):
    return tuple(f.shape[i] for i in range(f.ndim)), np.dtype(_NP_OF[f.dtype])


def _dataset_load_raw(cls, ctx: "Context", inputs_path: str, input_shape: Sequence[int],
                      input_dtype: Any, targets_path: str, target_shape: Sequence[int] = (),
                      target_dtype: Any = np.int32) -> "Dataset":
    """Samples back to back in raw little-endian files (memory-mapped): one input is
    input_shape of input_dtype, one target target_shape of target_dtype."""
    fi, ft = _field(input_shape, input_dtype), _field(target_shape, target_dtype)
    return cls(ctx, _C.dataset_load_raw(ctx.handle, _b(inputs_path), ctypes.byref(fi),
                                        _b(targets_path), ctypes.byref(ft)))


def _dataset_load_tokens(cls, ctx: "Context", path: str, token_bytes: int = 2, context: int = 64,
                         stride: Optional[int] = None, samples: int = 0, seed: int = 0,
                         first: int = 0, count: int = -1) -> "Dataset":
    """from_tokens over a file of token ids (token_bytes 1, 2 or 4 each), memory-mapped."""
    cfg = dt_token_config()
    _C.token_config_init(ctypes.byref(cfg))
    cfg.context, cfg.stride = context, context if stride is None else stride
    cfg.samples, cfg.seed, cfg.first, cfg.count = samples, seed, first, count
    return cls(ctx, _C.dataset_load_tokens(ctx.handle, _b(path), token_bytes, ctypes.byref(cfg)))


def _dataset_from_callback(cls, ctx: "Context", n: int,
                           fill: Callable[[int, np.ndarray, np.ndarray], None],
                           input_shape: Sequence[int], input_dtype: Any = np.float32,
                           target_shape: Sequence[int] = (),
                           target_dtype: Any = np.int32) -> "Dataset":
    """n samples made on demand: fill(i, x, y) writes sample i into the NumPy arrays x
    (input_shape) and y (target_shape).  It runs on the loader's prefetch thread; an
    exception fails that batch."""
    fi, ft = _field(input_shape, input_dtype), _field(target_shape, target_dtype)
    xs, xd = _field_shape(fi)
    ys, yd = _field_shape(ft)

    def trampoline(user, i, xp, yp):
        try:
            # fill writes arrays of its own, copied in after: one it keeps is never
            # memory the loader reuses
            x, y = np.zeros(xs, xd), np.zeros(ys, yd)
            fill(i, x, y)
            ctypes.memmove(xp, x.ctypes.data, x.nbytes)
            ctypes.memmove(yp, y.ctypes.data, y.nbytes)
            return 0
        except BaseException:
            return 1

    cb = _SAMPLE_FN(trampoline)
    ds = cls(ctx, _C.dataset_from_callback(ctx.handle, n, ctypes.byref(fi), ctypes.byref(ft),
                                           cb, None))
    ds._keep = (cb, fill)
    return ds


def _dataset_fields(self) -> Tuple[Tuple[Tuple[int, ...], Any], Tuple[Tuple[int, ...], Any]]:
    """((input shape, dtype), (target shape, dtype)) of one sample."""
    fi, ft = dt_sample_field(), dt_sample_field()
    self.ctx.check(_C.dataset_fields(self.handle, ctypes.byref(fi), ctypes.byref(ft)))
    return _field_shape(fi), _field_shape(ft)


def _dataset_sample(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
    """Sample i as NumPy arrays (x, y), copied."""
    (xs, xd), (ys, yd) = self.fields
    x, y = np.empty(xs, xd), np.empty(ys, yd)
    self.ctx.check(_C.dataset_sample(self.handle, i, x.ctypes.data, y.ctypes.data))
    return x, y


Dataset.load_raw = classmethod(_dataset_load_raw)
Dataset.load_tokens = classmethod(_dataset_load_tokens)
Dataset.from_callback = classmethod(_dataset_from_callback)
Dataset.fields = property(_dataset_fields)
Dataset.sample = _dataset_sample
Dataset.__getitem__ = _dataset_sample


def _loader_batch_slice(self) -> Tuple[int, int, int]:
    """(offset, count, global) of the last batch: its rows within the global batch."""
    o, c, g = _I64(), _I64(), _I64()
    _C.loader_batch_slice(self.handle, ctypes.byref(o), ctypes.byref(c), ctypes.byref(g))
    return o.value, c.value, g.value


def _loader_set_split(self, weights: Sequence[float]) -> None:
    """Cut each global batch between the shards in these proportions (dt_loader_set_split)."""
    w = (_D * len(weights))(*weights)
    self.ctx.check(_C.loader_set_split(self.handle, w, len(weights)))


def _loader_steal(self, comm: "Comm", chunk_batches: int) -> None:
    """Work stealing between the ranks of comm (dt_loader_steal), chunks of that many batches."""
    self.ctx.check(_C.loader_steal(self.handle, comm.handle, chunk_batches))
    self._steal_comm = comm


def _loader_iter(self) -> Iterator[Tuple["Tensor", "Tensor"]]:
    """for x, y in loader: the next epoch's batches (epochs counted from 0)."""
    e = getattr(self, "_next_epoch", 0)
    self._next_epoch = e + 1
    return self.epoch(e)


Loader.batch_slice = property(_loader_batch_slice)
Loader.set_split = _loader_set_split
Loader.steal = _loader_steal
Loader.batches_done = property(lambda self: _C.loader_batches_done(self.handle),
                               doc="Batches this loader gave in the epoch so far.")
Loader.batches_stolen = property(lambda self: _C.loader_batches_stolen(self.handle),
                                 doc="Of them, batches taken from other ranks' shards (steal).")
Loader.__iter__ = _loader_iter


# --- 15. the store, collectives in the background, launching -------------------------------

class Store(_Handle):
    """dt_store: the job's key-value rendezvous (rank 0 serves it; collective to open).
    env: a DistEnv (default: this process's, dist_env(ctx))."""
    _close_order = 3
    _what = "store"
    _free = staticmethod(_C.store_free)

    def __init__(self, ctx: "Context", env: Optional["DistEnv"] = None, token: Optional[str] = None,
                 bind_addr: Optional[str] = None, timeout_ms: int = 0) -> None:
        e = dt_dist_env()
        if env is None:
            ctx.check(_C.dist_env_detect(ctx.handle, ctypes.byref(e)))
        else:
            e.rank, e.world_size, e.local_rank, e.local_world_size = env[:4]
            e.master_addr, e.master_port = _b(env.master_addr), env.master_port
        c = dt_store_config()
        _C.store_config_init(ctypes.byref(c))
        self._strings = (_b(token), _b(bind_addr))   # borrowed by C until open returns
        c.token, c.bind_addr, c.timeout_ms = self._strings[0], self._strings[1], timeout_ms
        self._own(ctx, _C.store_new(ctx.handle, ctypes.byref(e), ctypes.byref(c)))

    @property
    def port(self) -> int:
        """The port rank 0 serves the store on."""
        return _C.store_port(self.handle)

    def set(self, key: str, value: Union[bytes, str]) -> None:
        """Set key to value (bytes or str)."""
        v = value.encode() if isinstance(value, str) else bytes(value)
        self.ctx.check(_C.store_set(self.handle, _b(key), v, len(v)))

    def get(self, key: str, timeout_ms: int = 0, cap: int = 1 << 16) -> bytes:
        """key's value (bytes), waiting up to timeout_ms for it to be set (0: the store's)."""
        buf, n = ctypes.create_string_buffer(cap), _SZ()
        self.ctx.check(_C.store_get(self.handle, _b(key), buf, cap, ctypes.byref(n), timeout_ms))
        return buf.raw[:n.value]

    def add(self, key: str, delta: int = 1) -> int:
        """Add delta to the integer at key (0 if unset); its new value."""
        v = _I64()
        self.ctx.check(_C.store_add(self.handle, _b(key), delta, ctypes.byref(v)))
        return v.value


class Work:
    """A collective running in the background; wait() finishes it (dt_work_wait)."""

    def __init__(self, ctx: "Context", h: int, keep: Any) -> None:
        if not h:
            raise ctx.error()
        self.ctx, self._h, self._keep = ctx, h, keep

    def wait(self) -> None:
        """Wait for the collective to finish; raises its failure."""
        if self._h is None:
            raise BadState(7, "this work was waited for already")
        h, self._h = self._h, None
        st = _C.work_wait(h)
        self._keep = None
        self.ctx.check(st)

    def __del__(self):
        try:
            if self._h is not None:
                _C.work_wait(self._h)
        except Exception:
            pass


def _comm_allreduce_async(self, array: np.ndarray, op: str = "sum") -> "Work":
    """allreduce in the background: array is reduced in place once the Work's wait() returns."""
    p = _f32_buffer(array, "allreduce_async")
    return Work(self.ctx, _C.comm_allreduce_async(self.handle, p, array.size, _REDUCE[op]), array)


def _comm_reduce_scatter(self, array: np.ndarray, out: np.ndarray, op: str = "sum") -> None:
    """Reduce array (size * n floats) over the ranks; rank r gets part r (n floats) in out."""
    _f32_buffer(array, "reduce_scatter")
    self.ctx.check(_C.comm_reduce_scatter(self.handle, array.ctypes.data, out.size,
                                     _f32_buffer(out, "reduce_scatter"), _REDUCE[op]))


def _comm_alltoall(self, array: np.ndarray, out: np.ndarray) -> None:
    """Part j (n floats) of array goes to rank j; out's part i comes from rank i."""
    _f32_buffer(array, "alltoall")
    n = array.size // self.size
    self.ctx.check(_C.comm_alltoall(self.handle, array.ctypes.data, n, _f32_buffer(out, "alltoall")))


Comm.allreduce_async = _comm_allreduce_async
Comm.reduce_scatter = _comm_reduce_scatter
Comm.alltoall = _comm_alltoall
Comm.hosts = property(lambda self: _C.comm_hosts(self.handle),
                      doc="The number of hosts the ranks are on.")
Comm.intra_host = property(lambda self: _C.comm_intra_host(self.handle).decode(),
                           doc="How ranks on one host reach each other (\"shm\", ...).")
Comm.bytes_sent = property(lambda self: _C.comm_bytes_sent(self.handle),
                           doc="Bytes this rank's collectives sent so far.")


def _spawn_config(nranks, transport, grace_ms, max_restarts, min_ranks, prefix_output, bind_cpus):
    c = dt_spawn_config()
    _C.spawn_config_init(ctypes.byref(c))
    c.nranks, c.transport = nranks, _b(transport)
    c.max_restarts, c.min_ranks = max_restarts, min_ranks
    if grace_ms is not None:
        c.grace_ms = grace_ms
    if prefix_output is not None:
        c.prefix_output = int(prefix_output)
    c.bind_cpus = int(bind_cpus)
    return c


def spawn(ctx: "Context", nranks: int, transport: Optional[str] = None,
          grace_ms: Optional[int] = None, max_restarts: int = 0, min_ranks: int = 0,
          prefix_output: Optional[bool] = None, bind_cpus: bool = False) -> int:
    """Fork this program into nranks processes (dt_spawn): each child returns its rank
    (then make a Comm as under a launcher); the parent waits for them all and returns -1.
    Before anything that starts threads (a Comm, a Loader with prefetch)."""
    c = _spawn_config(nranks, transport, grace_ms, max_restarts, min_ranks, prefix_output,
                      bind_cpus)
    rank = _I(-1)
    ctx.check(_C.spawn(ctx.handle, ctypes.byref(c), ctypes.byref(rank)))
    return rank.value


def launch(ctx: "Context", argv: Sequence[str], nranks: int, transport: Optional[str] = None,
           grace_ms: Optional[int] = None, max_restarts: int = 0, min_ranks: int = 0,
           prefix_output: Optional[bool] = None, bind_cpus: bool = False) -> None:
    """Run the program argv as nranks ranks and wait (dt_launch, what dtrun does).  Raises
    the job's failure; its .failed_rank says which rank failed first (-1: none)."""
    c = _spawn_config(nranks, transport, grace_ms, max_restarts, min_ranks, prefix_output,
                      bind_cpus)
    args = [_b(a) for a in argv] + [None]
    failed = _I(-1)
    st = _C.launch(ctx.handle, ctypes.byref(c), (_S * len(args))(*args), ctypes.byref(failed))
    if st:
        e = ctx.error()
        e.failed_rank = failed.value
        raise e


def dtrun_main() -> None:
    """The `dtrun` command pip installs: the launcher (examples/dtrun.c) shipped beside
    the library, run with this command's arguments (dtrun -n 2 python train.py)."""
    import sys
    exe = os.path.join(os.path.dirname(os.path.realpath(library_path)), "dtrun")
    if not os.access(exe, os.X_OK):
        sys.exit("dtrun: no launcher beside %s (pip ships it from the source tree's "
                 "build/portable/dtrun: ./build.sh python, then pip install again)" % library_path)
    os.execv(exe, [exe] + sys.argv[1:])


def _ddp_balance(self, loader: "Loader", every: int = 50) -> None:
    """Cut each global batch by the ranks' measured speed (dt_ddp_balance)."""
    self.ctx.check(_C.ddp_balance(self.handle, loader.handle, every))
    self._balanced = loader


DDP.balance = _ddp_balance
DDP.balance_share = property(lambda self: _C.ddp_balance_share(self.handle),
                             doc="This rank's share of each global batch under balance().")


# --- 16. in-process replicas, Hogwild!, parameter servers -----------------------------------

class _Models:
    """Python models handed through C as small integers (C's void *)."""

    def __init__(self):
        self._next, self.of = 1, {}

    def add(self, model):
        k, self._next = self._next, self._next + 1
        self.of[k] = model
        return k


def _borrowed_context(h):
    """A Context over a handle the library owns (a replica's, a thread's): never freed here."""
    c = Context.__new__(Context)
    c._h, c.step, c._children, c._deferred, c._log = h, _Life(), [], [], None
    c._borrowed = True
    c._backward_failure, c._in_backward = [], False
    c.persist, c._views, c._zombie = _Life(), 0, None
    return c


def _optim_config_of(kind, lr, **cfg):
    c = dt_optim_config()
    _C.optim_config_init(ctypes.byref(c), _OPTIMS[kind])
    if lr is not None:
        c.lr = lr
    for k, v in cfg.items():
        if k not in dict(c._fields_) or k == "struct_size":
            raise InvalidArgument(1, "optimizer: no setting '%s'" % k)
        setattr(c, k, v)
    return c


class Replicas(_Handle):
    """K model replicas in this process, one thread each, trained data-parallel on one
    batch split K ways (dt_dp).  build(ctx, k) -> model makes replica k's model with
    parameters in its own Context; loss(ctx, model, x, y) -> a scalar Tensor.  The loss
    calls overlap (K threads; Python runs one at a time)."""
    _close_order = 1
    _what = "replicas"
    _free = staticmethod(_C.dp_free)

    def __init__(self, ctx: "Context", build: Callable[["Context", int], Any],
                 loss: Callable[["Context", Any, "Tensor", "Tensor"], "Tensor"], replicas: int = 2,
                 optim: str = "sgd", lr: Optional[float] = None, threads: int = 1, seed: int = 0,
                 **optim_cfg: Any) -> None:
        c = dt_dp_config()
        _C.dp_config_init(ctypes.byref(c))
        c.replicas = replicas
        c.replica.threads, c.replica.seed = threads, seed
        c.optim = _optim_config_of(optim, lr, **optim_cfg)
        self._models, self._ctxs, self._failure = _Models(), {}, []

        def ctx_of(h):
            if h not in self._ctxs:
                self._ctxs[h] = _borrowed_context(h)
            return self._ctxs[h]

        def on_build(ctx_h, k, user):
            try:
                return self._models.add(build(ctx_of(ctx_h), k))
            except BaseException as e:
                self._failure.append(e)
                return None

        def on_loss(ctx_h, model, x_h, y_h, user):
            try:
                rc = ctx_of(ctx_h)
                x, y = Tensor._made(rc, x_h, rc.step), Tensor._made(rc, y_h, rc.step)
                return loss(rc, self._models.of[model], x, y).handle
            except BaseException as e:
                self._failure.append(e)
                return None

        def on_free(model, user):
            self._models.of.pop(model, None)

        self._cbs = (_BUILD_FN(on_build), _DP_LOSS_FN(on_loss), _FREE_FN(on_free))
        h = _C.dp_new(ctx.handle, ctypes.byref(c), *self._cbs, None)
        if self._failure:
            raise self._failure[0]
        self._own(ctx, h)

    def _raise(self, st):
        for rc in self._ctxs.values():
            rc._step_ended()
        if self._failure:
            e, self._failure = self._failure[0], []
            raise e
        self.ctx.check(st)

    def step(self, x: "Tensor", y: "Tensor") -> float:
        """One step on batch x, y; the batch's mean loss."""
        loss = _F()
        self._raise(_C.dp_step(self.handle, x.handle, y.handle, ctypes.byref(loss)))
        return loss.value

    def __len__(self):
        return _C.dp_replicas(self.handle)

    def replica(self, k: int) -> "Context":
        """Replica k's Context (owned by the replicas: do not close it)."""
        h = _C.dp_replica(self.handle, k)
        if not h:
            raise InvalidArgument(1, "replica %d of %d" % (k, len(self)))
        return self._ctxs.get(h) or _borrowed_context(h)

    def model(self, k: int) -> Any:
        """What build returned for replica k."""
        m = _C.dp_model(self.handle, k)
        if not m:
            raise InvalidArgument(1, "replica %d of %d" % (k, len(self)))
        return self._models.of[m]


HogwildStats = namedtuple("HogwildStats", "steps mean_loss rows_updated dense_updates")


def hogwild(ctx: "Context", build: Callable[["Context", int], Any],
            loss: Callable[["Context", Any, int, int], "Tensor"], threads: int = 2,
            steps: int = 1000, lr: float = 0.01, thread_threads: int = 1,
            seed: int = 0) -> "HogwildStats":
    """Hogwild! (dt_hogwild_run): threads threads step ctx's parameters without locks,
    steps steps in all, SGD at lr.  build(ctx, k) -> model on thread k's own Context
    (parameters named as ctx's); loss(ctx, model, k, step) -> a scalar Tensor.  Blocks
    until done; HogwildStats."""
    c = dt_hogwild_config()
    _C.hogwild_config_init(ctypes.byref(c))
    c.threads, c.steps, c.lr = threads, steps, lr
    c.thread.threads, c.thread.seed = thread_threads, seed
    models, ctxs, failure = _Models(), {}, []
    lock = threading.Lock()

    def ctx_of(h):
        with lock:
            if h not in ctxs:
                ctxs[h] = _borrowed_context(h)
            return ctxs[h]

    def on_build(ctx_h, k, user):
        try:
            return models.add(build(ctx_of(ctx_h), k))
        except BaseException as e:
            failure.append(e)
            return None

    def on_loss(ctx_h, model, k, step, user):
        try:
            tc = ctx_of(ctx_h)
            tc._step_ended()   # the thread's previous step's tensors are gone
            return loss(tc, models.of[model], k, step).handle
        except BaseException as e:
            failure.append(e)
            return None

    cbs = (_BUILD_FN(on_build), _HW_LOSS_FN(on_loss), _FREE_FN(lambda m, u: models.of.pop(m, None)))
    out = dt_hogwild_stats()
    st = _C.hogwild_run(ctx.handle, ctypes.byref(c), *cbs, None, ctypes.byref(out))
    if failure:
        raise failure[0]
    ctx.check(st)
    return HogwildStats(out.steps, out.mean_loss, out.rows_updated, out.dense_updates)


_PS_MODES = {"auto": -1, "bsp": 0, "asp": 1, "ssp": 2}


class ParameterServer(_Handle):
    """dt_ps: the parameter-server job on comm (collective: every rank makes one).  The last
    `servers` ranks serve (serve()); the others are workers whose registered parameters
    are the model.  tables: [(name, rows, dim, init_scale, seed)] sparse embedding tables
    that live on the servers only.  optim and its keywords: the servers' optimizer;
    schedule: its learning-rate schedule, Optimizer.set_schedule's arguments as a dict
    (counted in server steps)."""
    _close_order = 1
    _what = "parameter server"
    _free = staticmethod(_C.ps_free)

    def __init__(self, ctx: "Context", comm: "Comm", servers: int = 0, mode: str = "auto",
                 staleness: int = -1, optim: str = "sgd", lr: Optional[float] = None,
                 tables: Sequence[Tuple[str, int, int, float, int]] = (), replicate: bool = False,
                 checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0,
                 rejoin_ms: int = 0, chunk_bytes: int = 0, prefetch: bool = False,
                 schedule: Optional[Dict[str, Any]] = None, **optim_cfg: Any) -> None:
        c = dt_ps_config()
        _C.ps_config_init(ctypes.byref(c))
        if mode not in _PS_MODES:
            raise InvalidArgument(1, "ps: mode is one of %s" % ", ".join(_PS_MODES))
        c.servers, c.mode, c.staleness = servers, _PS_MODES[mode], staleness
        c.optim = _optim_config_of(optim, lr, **optim_cfg)
        if schedule:
            c.schedule = _schedule_of(**schedule)
        self._tables = (dt_ps_table * max(len(tables), 1))()
        for i, (name, rows, dim, scale, seed) in enumerate(tables):
            self._tables[i] = dt_ps_table(_b(name), rows, dim, scale, seed)
        c.tables, c.ntables = self._tables, len(tables)
        c.replicate, c.checkpoint_every, c.rejoin_ms = int(replicate), checkpoint_every, rejoin_ms
        self._dir = _b(checkpoint_dir)
        c.checkpoint_dir, c.chunk_bytes, c.prefetch = self._dir, chunk_bytes, int(prefetch)
        self.comm = comm
        self._own(ctx, _C.ps_new(ctx.handle, comm.handle, ctypes.byref(c)))
        self._borrow(comm)
        self._dims = [t[2] for t in tables]

    is_server = property(lambda self: bool(_C.ps_is_server(self.handle)),
                         doc="Whether this rank is a server (it calls serve()).")
    workers = property(lambda self: _C.ps_workers(self.handle), doc="The job's worker count.")
    servers = property(lambda self: _C.ps_servers(self.handle), doc="The job's server count.")

    def serve(self) -> None:
        """Servers: serve until every worker has finished."""
        self.ctx.check(_C.ps_serve(self.handle))

    def push_pull(self) -> None:
        """Workers: push this step's gradients, then pull the parameters (waiting as the
        consistency model says)."""
        self.ctx.check(_C.ps_push_pull(self.handle))

    def push(self) -> None:
        """Workers: push this step's gradients without pulling."""
        self.ctx.check(_C.ps_push(self.handle))

    def pull(self) -> None:
        """Workers: pull the parameters without pushing."""
        self.ctx.check(_C.ps_pull(self.handle))

    def finish(self) -> None:
        """Workers: this worker is done; the servers stop waiting for it."""
        self.ctx.check(_C.ps_finish(self.handle))

    def _ids(self, table, ids):
        if not 0 <= table < len(self._dims):
            raise InvalidArgument(1, "ps: no table %d" % table)
        return np.ascontiguousarray(ids, np.int64)

    def sparse_pull(self, table: int, ids: Sequence[int]) -> np.ndarray:
        """Rows ids of table, as a (len(ids), dim) float32 array."""
        ids = self._ids(table, ids)
        out = np.empty((ids.size, self._dims[table]), np.float32)
        self.ctx.check(_C.ps_sparse_pull(self.handle, table, ids.ctypes.data_as(_I64P), ids.size,
                                         out.ctypes.data_as(_FP)))
        return out

    def sparse_pull_async(self, table: int, ids: Sequence[int]) -> Tuple["Work", np.ndarray]:
        """sparse_pull in the background: (Work, rows); rows is filled once wait() returns."""
        ids = self._ids(table, ids)
        out = np.empty((ids.size, self._dims[table]), np.float32)
        h = _C.ps_sparse_pull_async(self.handle, table, ids.ctypes.data_as(_I64P), ids.size,
                                    out.ctypes.data_as(_FP))
        return Work(self.ctx, h, out), out

    def sparse_push(self, table: int, ids: Sequence[int], grads: np.ndarray) -> None:
        """Gradient rows for ids of table (len(ids) x dim), part of this worker's step."""
        ids = self._ids(table, ids)
        g = np.ascontiguousarray(grads, np.float32)
        if g.shape != (ids.size, self._dims[table]):
            raise InvalidArgument(1, "ps: grads %s for %d ids of dim %d" % (g.shape, ids.size,
                                                                            self._dims[table]))
        self.ctx.check(_C.ps_sparse_push(self.handle, table, ids.ctypes.data_as(_I64P), ids.size,
                                         g.ctypes.data_as(_FP)))

    def stats(self) -> Dict[str, Any]:
        """This rank's totals since it joined (pushes, pulls, staleness, rows, ...)."""
        s = dt_ps_stats()
        self.ctx.check(_C.ps_stats_get(self.handle, ctypes.byref(s)))
        return {f: getattr(s, f) for f, _ in s._fields_}


# --- 17. predictions, the live monitor -------------------------------------------------------

def predict(ctx: "Context", dataset: "Dataset", forward: Callable[["Tensor"], "Tensor"],
            comm: Optional["Comm"] = None, batch: int = 128, mean: float = 0.0,
            std: float = 1.0) -> Optional[np.ndarray]:
    """dt_predict: the arg-max class of forward(x)'s logits for every sample, in order, as
    an int32 array (on rank 0; other ranks get None).  Collective with comm."""
    cfg = dt_eval_config()
    _C.eval_config_init(ctypes.byref(cfg))
    cfg.batch, cfg.mean, cfg.std = batch, mean, std
    failure, call_life = [], _Life()

    def trampoline(ctx_h, x_h, user):
        try:
            return forward(Tensor._made(ctx, x_h, call_life)).handle
        except BaseException as e:
            failure.append(e)
            return None

    cb = _FORWARD_FN(trampoline)
    rank0 = comm is None or comm.rank == 0
    out = np.empty(len(dataset), np.int32) if rank0 else None
    st = _C.predict(ctx.handle, comm.handle if comm else None, dataset.handle, ctypes.byref(cfg),
                    cb, None, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)) if rank0 else None)
    call_life.gen += 1
    ctx._step_ended()
    if failure:
        raise failure[0]
    ctx.check(st)
    return out


class Monitor(_Handle):
    """The live monitor (dt_monitor_new): rank 0 serves a page, /api/state, /events and
    Prometheus /metrics on listen ("[host:]port"; None: DTRAIN_MONITOR, else a free
    loopback port, see .port); other ranks publish.  Collective with comm."""
    _close_order = 0
    _what = "monitor"
    _free = staticmethod(_C.monitor_free)

    def __init__(self, ctx: "Context", comm: Optional["Comm"] = None, listen: Optional[str] = None,
                 interval_s: float = 1.0, token: Optional[str] = None) -> None:
        c = dt_monitor_config()
        _C.monitor_config_init(ctypes.byref(c))
        self._strings = (_b(listen), _b(token))
        c.listen, c.token, c.interval_s = self._strings[0], self._strings[1], interval_s
        self.comm = comm
        self._own(ctx, _C.monitor_new(ctx.handle, comm.handle if comm else None, ctypes.byref(c)))
        self._borrow(comm)

    @property
    def port(self) -> int:
        """The port rank 0 serves on (0 on other ranks)."""
        return _C.monitor_port(self.handle)

    def log(self, name: str, step: int, value: float) -> None:
        """A scalar for the page's curves and /metrics (e.g. "loss", "val_loss", "lr")."""
        self.ctx.check(_C.monitor_log(self.handle, _b(name), step, value))


def profiling(ctx: "Context") -> bool:
    """True while ctx's profiler records (profile_start, or DTRAIN_PROFILE=1)."""
    return bool(_C.profile_active(ctx.handle))


def profile_straggler(ctx: "Context") -> int:
    """The rank the profiler's latest check named a straggler, or -1 (same on every rank)."""
    return _C.profile_straggler(ctx.handle)


def schedule_lr(base_lr: float, step: int, kind: str = "cosine", total_steps: int = 0,
                warmup_steps: int = 0, min_lr: float = 0.0, step_size: int = 0,
                gamma: float = 0.1) -> float:
    """The learning rate a schedule gives at step (Optimizer.set_schedule's arithmetic)."""
    s = _schedule_of(kind, total_steps, warmup_steps, min_lr, step_size, gamma)
    return _C.schedule_lr(ctypes.byref(s), base_lr, step)


def strerror(status: int) -> str:
    """The generic text of a dt_status code (an Error's .status)."""
    return _C.strerror(status).decode()
