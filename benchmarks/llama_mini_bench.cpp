// llama.cpp's CPU speed for benchmarks/cpu_decode.py, built by build_llama_bench.sh: a minimal
// stand-in for llama-bench on the public llama.h API. pp: one prompt of -p random tokens; tg: -n
// tokens one by one from an empty context; best of -r repetitions each; llama-bench's JSON fields
// (n_prompt, n_gen, avg_ts) on stdout. Flags: -m MODEL -t THREADS -p N -n N -r N [-b SEQS].
// -b SEQS > 1: tg decodes SEQS sequences at once (one llama_decode of SEQS tokens a step, each its
// own sequence, from empty contexts), avg_ts their tokens a second in all, with "n_seq": SEQS.
#include "llama.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char ** argv) {
    std::string model; int threads = 2, n_prompt = 512, n_gen = 128, reps = 1, n_seq = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        std::string a = argv[i];
        if (a == "-m") model = argv[i + 1];
        else if (a == "-t") threads = atoi(argv[i + 1]);
        else if (a == "-p") n_prompt = atoi(argv[i + 1]);
        else if (a == "-n") n_gen = atoi(argv[i + 1]);
        else if (a == "-r") reps = atoi(argv[i + 1]);
        else if (a == "-b") n_seq = std::max(1, atoi(argv[i + 1]));
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * m = llama_model_load_from_file(model.c_str(), mp);
    if (!m) { fprintf(stderr, "cannot load %s\n", model.c_str()); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = std::max(n_prompt, n_seq * (n_gen + 16)) + 16; cp.n_batch = 2048; cp.n_ubatch = 512;
    cp.n_seq_max = n_seq;
    if (n_seq > 1) cp.kv_unified = false;  // a cache a sequence: llama.h advises it without shared prefixes
    cp.n_threads = threads; cp.n_threads_batch = threads;
    llama_context * ctx = llama_init_from_model(m, cp);
    const llama_vocab * vocab = llama_model_get_vocab(m);
    int n_vocab = llama_vocab_n_tokens(vocab);
    std::mt19937 rng(42);
    std::vector<llama_token> toks(std::max(n_prompt, 1));
    for (auto & t : toks) t = rng() % n_vocab;
    llama_token bos = llama_vocab_bos(vocab);
    // warm up
    llama_decode(ctx, llama_batch_get_one(&bos, 1)); llama_synchronize(ctx);
    llama_memory_clear(llama_get_memory(ctx), true);
    double best_pp = 0, best_tg = 0;
    for (int r = 0; r < reps; r++) {
        if (n_prompt > 0) {
            llama_memory_clear(llama_get_memory(ctx), true);
            double t = now();
            llama_decode(ctx, llama_batch_get_one(toks.data(), n_prompt)); llama_synchronize(ctx);
            double ts = n_prompt / (now() - t); if (ts > best_pp) best_pp = ts;
        }
        if (n_gen > 0 && n_seq == 1) {
            llama_memory_clear(llama_get_memory(ctx), true);
            llama_token tok = bos;
            double t = now();
            for (int i = 0; i < n_gen; i++) {
                llama_decode(ctx, llama_batch_get_one(&tok, 1)); llama_synchronize(ctx);
                tok = rng() % n_vocab;
            }
            double ts = n_gen / (now() - t); if (ts > best_tg) best_tg = ts;
        } else if (n_gen > 0) {
            llama_memory_clear(llama_get_memory(ctx), true);
            llama_batch batch = llama_batch_init(n_seq, 0, 1);
            double t = now();
            for (int i = 0; i < n_gen; i++) {
                batch.n_tokens = n_seq;
                for (int s = 0; s < n_seq; s++) {
                    batch.token[s] = i == 0 ? bos : (llama_token)(rng() % n_vocab);
                    batch.pos[s] = i; batch.n_seq_id[s] = 1; batch.seq_id[s][0] = s; batch.logits[s] = 1;
                }
                llama_decode(ctx, batch); llama_synchronize(ctx);
            }
            double ts = (double)n_seq * n_gen / (now() - t); if (ts > best_tg) best_tg = ts;
            llama_batch_free(batch);
        }
    }
    printf("[");
    if (n_prompt > 0)
        printf("{\"n_prompt\": %d, \"n_gen\": 0, \"avg_ts\": %f}%s", n_prompt, best_pp, n_gen > 0 ? ", " : "");
    if (n_gen > 0) printf("{\"n_prompt\": 0, \"n_gen\": %d, \"n_seq\": %d, \"avg_ts\": %f}", n_gen, n_seq, best_tg);
    printf("]\n");
    llama_free(ctx); llama_model_free(m);
    return 0;
}
