/* Prints every C struct the Python binding mirrors, as "struct field offset
 * size" lines and "struct - sizeof", for tests/test_dtrain.py to compare
 * with the ctypes layouts (a field added in dtrain.h and not in dtrain.py
 * shows up as a size mismatch). */
#include <stddef.h>
#include <stdio.h>

#include "dtrain.h"

#define F(s, name, path) \
    printf(#s " " #name " %zu %zu\n", offsetof(s, path), sizeof(((s *)0)->path))
#define END(s) printf(#s " - %zu\n", sizeof(s))

int main(void)
{
    F(dt_ctx_config, struct_size, struct_size);
    F(dt_ctx_config, backend, backend); F(dt_ctx_config, threads, threads); F(dt_ctx_config, seed, seed);
    F(dt_ctx_config, malloc_fn, allocator.malloc_fn); F(dt_ctx_config, realloc_fn, allocator.realloc_fn);
    F(dt_ctx_config, free_fn, allocator.free_fn); F(dt_ctx_config, alloc_user, allocator.user);
    F(dt_ctx_config, arena_bytes, arena_bytes); F(dt_ctx_config, device, device);
    F(dt_ctx_config, custom_backend, custom_backend); F(dt_ctx_config, arena_max_bytes, arena_max_bytes);
    END(dt_ctx_config);

    F(dt_mem_stats, arena_capacity, arena_capacity); F(dt_mem_stats, arena_used, arena_used);
    F(dt_mem_stats, arena_peak, arena_peak); F(dt_mem_stats, persistent_bytes, persistent_bytes);
    F(dt_mem_stats, arena_grows, arena_grows); END(dt_mem_stats);

    F(dt_optim_config, struct_size, struct_size);
    F(dt_optim_config, kind, kind); F(dt_optim_config, lr, lr);
    F(dt_optim_config, momentum, momentum); F(dt_optim_config, dampening, dampening);
    F(dt_optim_config, nesterov, nesterov); F(dt_optim_config, weight_decay, weight_decay);
    F(dt_optim_config, beta1, beta1); F(dt_optim_config, beta2, beta2);
    F(dt_optim_config, eps, eps); F(dt_optim_config, param_dtype, param_dtype);
    F(dt_optim_config, state_dtype, state_dtype); END(dt_optim_config);

    F(dt_param_group, struct_size, struct_size); F(dt_param_group, params, params);
    F(dt_param_group, n, n); F(dt_param_group, lr, lr); F(dt_param_group, momentum, momentum);
    F(dt_param_group, dampening, dampening); F(dt_param_group, weight_decay, weight_decay);
    F(dt_param_group, beta1, beta1); F(dt_param_group, beta2, beta2); F(dt_param_group, eps, eps);
    F(dt_param_group, nesterov, nesterov); END(dt_param_group);

    F(dt_schedule, kind, kind); F(dt_schedule, step_size, step_size); F(dt_schedule, gamma, gamma);
    F(dt_schedule, warmup_steps, warmup_steps); F(dt_schedule, total_steps, total_steps);
    F(dt_schedule, min_lr, min_lr); END(dt_schedule);

    F(dt_loader_config, struct_size, struct_size);
    F(dt_loader_config, batch, batch); F(dt_loader_config, shuffle, shuffle);
    F(dt_loader_config, drop_last, drop_last); F(dt_loader_config, seed, seed);
    F(dt_loader_config, mean, mean); F(dt_loader_config, std, std);
    F(dt_loader_config, prefetch, prefetch); F(dt_loader_config, shard_rank, shard_rank);
    F(dt_loader_config, shard_count, shard_count); F(dt_loader_config, shard_no_pad, shard_no_pad);
    F(dt_loader_config, global_batches, global_batches); END(dt_loader_config);

    F(dt_sample_field, dtype, dtype); F(dt_sample_field, ndim, ndim);
    F(dt_sample_field, shape, shape); END(dt_sample_field);

    F(dt_token_config, struct_size, struct_size);
    F(dt_token_config, context, context); F(dt_token_config, stride, stride);
    F(dt_token_config, samples, samples); F(dt_token_config, seed, seed);
    F(dt_token_config, first, first); F(dt_token_config, count, count); END(dt_token_config);

    F(dt_csv_config, struct_size, struct_size);
    F(dt_csv_config, delimiter, delimiter); F(dt_csv_config, header, header);
    F(dt_csv_config, target_name, target_name); F(dt_csv_config, target_column, target_column);
    F(dt_csv_config, classify, classify); END(dt_csv_config);

    F(dt_dist_env, rank, rank); F(dt_dist_env, world_size, world_size);
    F(dt_dist_env, local_rank, local_rank); F(dt_dist_env, local_world_size, local_world_size);
    F(dt_dist_env, master_addr, master_addr); F(dt_dist_env, master_port, master_port);
    F(dt_dist_env, launcher, launcher); END(dt_dist_env);

    F(dt_store_config, struct_size, struct_size);
    F(dt_store_config, token, token); F(dt_store_config, bind_addr, bind_addr);
    F(dt_store_config, timeout_ms, timeout_ms); END(dt_store_config);

    F(dt_comm_config, struct_size, struct_size);
    F(dt_comm_config, transport, transport); F(dt_comm_config, host, host);
    F(dt_comm_config, timeout_ms, timeout_ms); F(dt_comm_config, intra_host, intra_host);
    F(dt_comm_config, host_id, host_id); F(dt_comm_config, store, store);
    F(dt_comm_config, collective_timeout_ms, collective_timeout_ms); END(dt_comm_config);

    F(dt_ddp_config, struct_size, struct_size);
    F(dt_ddp_config, bucket_bytes, bucket_bytes); F(dt_ddp_config, overlap, overlap);
    F(dt_ddp_config, broadcast_params, broadcast_params); F(dt_ddp_config, compress, compress);
    F(dt_ddp_config, topk_ratio, topk_ratio); F(dt_ddp_config, topk_warmup_steps, topk_warmup_steps);
    F(dt_ddp_config, error_feedback, error_feedback); F(dt_ddp_config, ps, ps); END(dt_ddp_config);

    F(dt_ddp_stats, steps, steps); F(dt_ddp_stats, buckets, buckets);
    F(dt_ddp_stats, bucket_bytes, bucket_bytes); F(dt_ddp_stats, backward_s, backward_s);
    F(dt_ddp_stats, comm_s, comm_s); F(dt_ddp_stats, exposed_s, exposed_s);
    F(dt_ddp_stats, grad_bytes, grad_bytes); F(dt_ddp_stats, payload_bytes, payload_bytes);
    F(dt_ddp_stats, bytes_sent, bytes_sent); F(dt_ddp_stats, block_launches, block_launches);
    F(dt_ddp_stats, overlap, overlap); F(dt_ddp_stats, zero, zero);
    F(dt_ddp_stats, shard_floats, shard_floats); F(dt_ddp_stats, grad_bytes_peak, grad_bytes_peak);
    F(dt_ddp_stats, gather_s, gather_s); F(dt_ddp_stats, gather_exposed_s, gather_exposed_s);
    F(dt_ddp_stats, gathers, gathers); F(dt_ddp_stats, gathers_on_demand, gathers_on_demand);
    END(dt_ddp_stats);

    F(dt_eval_config, struct_size, struct_size);
    F(dt_eval_config, batch, batch); F(dt_eval_config, mean, mean); F(dt_eval_config, std, std);
    F(dt_eval_config, metric, metric); F(dt_eval_config, metric_fn, metric_fn);
    F(dt_eval_config, metric_user, metric_user); END(dt_eval_config);

    F(dt_metrics, samples, samples); F(dt_metrics, correct, correct);
    F(dt_metrics, accuracy, accuracy); F(dt_metrics, loss, loss); F(dt_metrics, value, value);
    END(dt_metrics);

    F(dt_profile_config, struct_size, struct_size);
    F(dt_profile_config, max_events, max_events);
    F(dt_profile_config, straggler_threshold, straggler_threshold);
    F(dt_profile_config, check_every, check_every); END(dt_profile_config);

    F(dt_profile_stats, rank, rank); F(dt_profile_stats, steps, steps);
    F(dt_profile_stats, step_s, step_s); F(dt_profile_stats, data_s, data_s);
    F(dt_profile_stats, forward_s, forward_s); F(dt_profile_stats, backward_s, backward_s);
    F(dt_profile_stats, comm_wait_s, comm_wait_s); F(dt_profile_stats, optimizer_s, optimizer_s);
    F(dt_profile_stats, idle_s, idle_s); F(dt_profile_stats, comm_s, comm_s);
    F(dt_profile_stats, collectives, collectives); F(dt_profile_stats, coll_bytes, coll_bytes);
    F(dt_profile_stats, busbw, busbw); F(dt_profile_stats, ps_calls, ps_calls);
    F(dt_profile_stats, ps_latency_s, ps_latency_s);
    F(dt_profile_stats, ps_max_staleness, ps_max_staleness);
    F(dt_profile_stats, ps_mean_staleness, ps_mean_staleness);
    F(dt_profile_stats, samples, samples); F(dt_profile_stats, events, events);
    F(dt_profile_stats, dropped, dropped);
    F(dt_profile_stats, straggler_warnings, straggler_warnings);
    F(dt_profile_stats, pipe_wait_s, pipe_wait_s);
    F(dt_profile_stats, pipe_bubble_ideal, pipe_bubble_ideal);
    F(dt_profile_stats, ps_serve_s, ps_serve_s); F(dt_profile_stats, ps_busy_s, ps_busy_s);
    F(dt_profile_stats, ps_stalled_s, ps_stalled_s); F(dt_profile_stats, ps_served, ps_served);
    F(dt_profile_stats, ps_bytes_in, ps_bytes_in); F(dt_profile_stats, ps_bytes_out, ps_bytes_out);
    F(dt_profile_stats, ps_queue_max, ps_queue_max); F(dt_profile_stats, ps_keys, ps_keys);
    F(dt_profile_stats, gather_s, gather_s); F(dt_profile_stats, gather_exposed_s, gather_exposed_s);
    F(dt_profile_stats, gathers, gathers); F(dt_profile_stats, gathers_on_demand, gathers_on_demand);
    F(dt_profile_stats, wall_s, wall_s); F(dt_profile_stats, cpu_s, cpu_s);
    F(dt_profile_stats, cpu_wait_s, cpu_wait_s); F(dt_profile_stats, throttled_s, throttled_s);
    F(dt_profile_stats, cpu_periods, cpu_periods);
    F(dt_profile_stats, cpu_throttled_periods, cpu_throttled_periods);
    F(dt_profile_stats, longest_wait_s, longest_wait_s);
    F(dt_profile_stats, longest_wait_rank, longest_wait_rank);
    F(dt_profile_stats, ps_slowest_server, ps_slowest_server);
    F(dt_profile_stats, ps_slowest_server_ms, ps_slowest_server_ms);
    F(dt_profile_stats, ps_server_median_ms, ps_server_median_ms);
    F(dt_profile_stats, eval_s, eval_s);
    F(dt_profile_stats, ckpt_s, ckpt_s);
    F(dt_profile_stats, threads, threads);
    END(dt_profile_stats);

    F(dt_checkpoint_config, struct_size, struct_size); F(dt_checkpoint_config, dtype, dtype);
    F(dt_checkpoint_config, n_meta, n_meta); F(dt_checkpoint_config, meta_keys, meta_keys);
    F(dt_checkpoint_config, meta_values, meta_values); F(dt_checkpoint_config, strict, strict);
    END(dt_checkpoint_config);

    F(dt_checkpoint_report, loaded, loaded); F(dt_checkpoint_report, missing, missing);
    F(dt_checkpoint_report, unexpected, unexpected);
    F(dt_checkpoint_report, mismatched, mismatched); F(dt_checkpoint_report, names, names);
    END(dt_checkpoint_report);

    F(dt_loss_scale_config, struct_size, struct_size);
    F(dt_loss_scale_config, init_scale, init_scale);
    F(dt_loss_scale_config, growth_factor, growth_factor);
    F(dt_loss_scale_config, backoff_factor, backoff_factor);
    F(dt_loss_scale_config, growth_interval, growth_interval);
    END(dt_loss_scale_config);

    F(dt_spawn_config, struct_size, struct_size); F(dt_spawn_config, nranks, nranks);
    F(dt_spawn_config, transport, transport); F(dt_spawn_config, grace_ms, grace_ms);
    F(dt_spawn_config, max_restarts, max_restarts); F(dt_spawn_config, min_ranks, min_ranks);
    F(dt_spawn_config, prefix_output, prefix_output); F(dt_spawn_config, bind_cpus, bind_cpus);
    END(dt_spawn_config);

    F(dt_dp_config, struct_size, struct_size); F(dt_dp_config, replicas, replicas);
    F(dt_dp_config, replica, replica); F(dt_dp_config, optim, optim);
    END(dt_dp_config);

    F(dt_hogwild_config, struct_size, struct_size); F(dt_hogwild_config, threads, threads);
    F(dt_hogwild_config, steps, steps); F(dt_hogwild_config, lr, lr);
    F(dt_hogwild_config, thread, thread);
    END(dt_hogwild_config);

    F(dt_hogwild_stats, steps, steps); F(dt_hogwild_stats, mean_loss, mean_loss);
    F(dt_hogwild_stats, rows_updated, rows_updated);
    F(dt_hogwild_stats, dense_updates, dense_updates);
    END(dt_hogwild_stats);

    F(dt_ps_table, name, name); F(dt_ps_table, rows, rows); F(dt_ps_table, dim, dim);
    F(dt_ps_table, init_scale, init_scale); F(dt_ps_table, seed, seed);
    END(dt_ps_table);

    F(dt_ps_config, struct_size, struct_size); F(dt_ps_config, servers, servers);
    F(dt_ps_config, mode, mode); F(dt_ps_config, staleness, staleness);
    F(dt_ps_config, optim, optim); F(dt_ps_config, schedule, schedule);
    F(dt_ps_config, tables, tables); F(dt_ps_config, ntables, ntables);
    F(dt_ps_config, replicate, replicate); F(dt_ps_config, checkpoint_dir, checkpoint_dir);
    F(dt_ps_config, checkpoint_every, checkpoint_every); F(dt_ps_config, rejoin_ms, rejoin_ms);
    F(dt_ps_config, chunk_bytes, chunk_bytes); F(dt_ps_config, prefetch, prefetch);
    END(dt_ps_config);

    F(dt_ps_stats, pushes, pushes); F(dt_ps_stats, pulls, pulls); F(dt_ps_stats, steps, steps);
    F(dt_ps_stats, max_staleness, max_staleness); F(dt_ps_stats, mean_staleness, mean_staleness);
    F(dt_ps_stats, wait_s, wait_s); F(dt_ps_stats, dropped_workers, dropped_workers);
    F(dt_ps_stats, rows_pushed, rows_pushed); F(dt_ps_stats, rows_pulled, rows_pulled);
    F(dt_ps_stats, rows_updated, rows_updated); F(dt_ps_stats, checkpoints, checkpoints);
    F(dt_ps_stats, resumed, resumed); F(dt_ps_stats, resumed_step, resumed_step);
    F(dt_ps_stats, rejoined, rejoined); F(dt_ps_stats, rejoins, rejoins);
    END(dt_ps_stats);

    F(dt_monitor_config, struct_size, struct_size); F(dt_monitor_config, listen, listen);
    F(dt_monitor_config, interval_s, interval_s); F(dt_monitor_config, token, token);
    END(dt_monitor_config);
    F(dt_preempt_config, struct_size, struct_size); F(dt_preempt_config, signals, signals);
    END(dt_preempt_config);

    F(dt_pipe_config, struct_size, struct_size);
    F(dt_pipe_config, micro_batches, micro_batches); F(dt_pipe_config, schedule, schedule);
    END(dt_pipe_config);

    F(dt_pipe_stats, steps, steps); F(dt_pipe_stats, micro_batches, micro_batches);
    F(dt_pipe_stats, step_s, step_s); F(dt_pipe_stats, compute_s, compute_s);
    F(dt_pipe_stats, wait_s, wait_s); F(dt_pipe_stats, bubble, bubble);
    F(dt_pipe_stats, bubble_ideal, bubble_ideal); F(dt_pipe_stats, bytes_sent, bytes_sent);
    F(dt_pipe_stats, in_flight_peak, in_flight_peak);
    F(dt_pipe_stats, act_bytes_peak, act_bytes_peak); END(dt_pipe_stats);
    return 0;
}
