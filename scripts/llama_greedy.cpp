// Greedy decoding of token ids with llama.cpp (an outside reference for metashard's families).
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
int main(int argc, char **argv) {
    if (argc < 4 || atoi(argv[2]) < 1) {
        fprintf(stderr, "usage: %s MODEL.gguf N_PREDICT TOKEN_ID...\n", argv[0]);
        return 1;
    }
    llama_backend_init();
    auto mp = llama_model_default_params();
    llama_model *m = llama_model_load_from_file(argv[1], mp);
    if (!m) return 2;
    auto cp = llama_context_default_params();
    int n = atoi(argv[2]);
    std::vector<llama_token> toks;
    for (int i = 3; i < argc; i++) toks.push_back(atoi(argv[i]));
    // The context holds the prompt and every generated token; the prompt is one batch.
    cp.n_ctx = toks.size() + n + 1;
    cp.n_batch = toks.size();
    cp.n_threads = 2; cp.n_threads_batch = 2;
    llama_context *c = llama_init_from_model(m, cp);
    if (!c) return 3;
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(m));
    llama_batch b = llama_batch_get_one(toks.data(), toks.size());
    llama_token t;
    for (int s = 0; s < n; s++) {
        if (llama_decode(c, b)) return 4;
        const float *l = llama_get_logits_ith(c, -1);
        t = 0;
        for (int i = 1; i < nv; i++) if (l[i] > l[t]) t = i;
        printf("%d ", t);
        b = llama_batch_get_one(&t, 1);
    }
    printf("\n");
    return 0;
}
