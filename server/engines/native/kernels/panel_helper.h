// A second thread that takes panels of a linear from a caller that runs without an OpenMP team,
// with no barrier: where the caller would wait for it, the caller does the work itself.
//
// Why: beside busy processes the engine runs a step on one thread (core/execution.py), because
// every barrier of a team waits for whichever member the scheduler has descheduled. One thread
// holds one runnable thread's share of the CPUs. The helper is a second runnable thread for the
// step's linears, which share out the panels of one call: no weight is dequantised twice, and no
// one waits for a descheduled thread.
//
// A call (`run`, on the calling thread):
//   - closes the previous call's panels to the helper, copies x into the helper's own buffer,
//     publishes the call (the Job and a generation), and wakes the helper if it sleeps;
//   - claims panels one at a time from a shared counter, as the helper does, and computes them
//     into the output itself;
//   - the panels it did not compute are the helper's: those the helper has finished (their raw
//     float32 sums in the helper's result buffer, stamped with the generation) it finishes with the
//     epilogue; the one the helper may still be on it waits for briefly (twice its own mean panel
//     time) and otherwise computes itself.
// The helper reads nothing of the caller's but the weights: x is copied, results go to its own
// buffer, the epilogue (bias, the op, `other`) is the caller's. Late work of a helper that was
// descheduled mid-panel lands in that buffer stamped with an old generation, which no later call
// reads; but it may read a call's weights after the call has returned, so weights must outlive the
// helper: stop() (which joins it) before they are freed. Every panel is computed by the same
// function whichever thread runs it, so the output does not depend on who computed what.
//
// The helper sleeps on a futex between calls; a call wakes it (one system call where it sleeps).
// A caller that finds the helper in use by another thread, or a call larger than the buffers,
// runs alone.

#pragma once

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

namespace polyserve {

inline int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Job: trivially copyable, with `int64_t panels` and
//     void sums(int64_t p, const uint8_t* x, float* res) const
// computing panel p's raw float32 sums into res from x as copied (rows K apart).
template <class Job>
class PanelHelper {
    static_assert(std::is_trivially_copyable<Job>::value, "a job is copied word by word");
    static constexpr uint64_t CLOSED = 0xFFFFFFFFu;  // a claim word's panel: nothing to claim

   public:
    ~PanelHelper() { stop(); }

    // Starts the helper with buffers for x of up to x_bytes and results of up to res_floats floats
    // over up to `panels` panels (a running helper with smaller buffers is stopped first). Returns
    // false where the thread cannot start.
    bool start(size_t x_bytes, size_t res_floats, int64_t panels) {
        if (thread_.joinable() && x_.size() >= x_bytes + 64 && res_.size() >= res_floats + 16 &&
            static_cast<int64_t>(done_.size()) >= panels) {
            enabled_.store(true, std::memory_order_release);
            return true;
        }
        stop();
        x_.assign(x_bytes + 64, 0);
        res_.assign(res_floats + 16, 0.0f);
        done_ = std::vector<std::atomic<uint64_t>>(static_cast<size_t>(panels));
        for (auto& d : done_) d.store(0, std::memory_order_relaxed);
        stop_.store(false);
        // what the helper waits past: read here, as a call or stop() may come before the thread runs
        const uint32_t seen = seq_.load(std::memory_order_acquire);
        try {
            thread_ = std::thread([this, seen] { loop(seen); });
        } catch (...) {
            return false;
        }
        enabled_.store(true, std::memory_order_release);
        return true;
    }

    // Stops and joins the helper (it finishes the panel it is on): after this it reads nothing.
    void stop() {
        enabled_.store(false);
        if (!thread_.joinable()) return;
        while (busy_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();  // no call in flight
        stop_.store(true, std::memory_order_seq_cst);
        seq_.fetch_add(1, std::memory_order_seq_cst);
        futex_wake();
        thread_.join();
        busy_.store(false, std::memory_order_release);
    }

    bool running() const { return enabled_.load(std::memory_order_acquire); }

    // panels whose results the callers took from the helper, since the start
    uint64_t taken() const { return taken_.load(std::memory_order_relaxed); }

    // Tests: the helper sleeps this long after claiming each panel, as if descheduled mid-panel.
    void pause_after_claim(int64_t ns) { pause_ns_.store(ns, std::memory_order_relaxed); }

    // own(p): panel p computed and finished into the output on this thread; finish(p, sums): panel
    // p finished from the helper's raw sums (res_per_panel floats). Returns false, having done nothing, where
    // the helper is off, busy with another caller, or the call does not fit its buffers.
    template <class Own, class Finish>
    bool run(const Job& job, const uint8_t* x, int64_t x_rows, int64_t x_row_bytes, int64_t x_stride_bytes,
             int64_t res_per_panel, Own&& own, Finish&& finish) {
        if (!enabled_.load(std::memory_order_acquire)) return false;
        const size_t x_bytes = static_cast<size_t>(x_rows * x_row_bytes);
        if (job.panels > static_cast<int64_t>(done_.size()) || x_bytes + 64 > x_.size() ||
            static_cast<size_t>(job.panels * res_per_panel) + 16 > res_.size() || job.panels >= int64_t(CLOSED))
            return false;
        if (busy_.exchange(true, std::memory_order_acquire)) return false;
        const uint64_t gen = ++gen_;
        const uint64_t tag = (gen & 0xFFFFFFFFu) << 32;
        claim_.store(tag | CLOSED, std::memory_order_relaxed);  // the last call's panels are closed
        std::atomic_thread_fence(std::memory_order_release);
        uint8_t* xb = x_buffer();
        for (int64_t r = 0; r < x_rows; ++r) std::memcpy(xb + r * x_row_bytes, x + r * x_stride_bytes, x_row_bytes);
        store_job(job, gen, res_per_panel);
        claim_.store(tag, std::memory_order_release);
        seq_.fetch_add(1, std::memory_order_seq_cst);
        if (sleeping_.load(std::memory_order_seq_cst)) futex_wake();

        static thread_local std::vector<uint8_t> mine;
        mine.assign(static_cast<size_t>(job.panels), 0);
        const int64_t t0 = now_ns();
        int64_t count = 0;
        for (;;) {
            const uint64_t p = claim_.fetch_add(1, std::memory_order_acq_rel) & 0xFFFFFFFFu;
            if (static_cast<int64_t>(p) >= job.panels) break;
            own(static_cast<int64_t>(p));
            mine[p] = 1;
            ++count;
        }
        const int64_t grace = count ? 2 * (now_ns() - t0) / count : 20000;
        float* res = res_buffer();
        for (int64_t p = 0; p < job.panels; ++p) {
            if (mine[p]) continue;
            if (done_[p].load(std::memory_order_acquire) != gen) {
                const int64_t until = now_ns() + grace;
                while (done_[p].load(std::memory_order_acquire) != gen && now_ns() < until) _mm_pause();
            }
            if (done_[p].load(std::memory_order_acquire) == gen) {
                finish(p, res + p * res_per_panel);
                taken_.fetch_add(1, std::memory_order_relaxed);
            } else {
                own(p);
            }
        }
        busy_.store(false, std::memory_order_release);
        return true;
    }

   private:
    struct Posted {
        Job job;
        uint64_t gen;
        int64_t res_per_panel;
    };
    static constexpr int POSTED_WORDS = (sizeof(Posted) + 7) / 8;

    uint8_t* x_buffer() { return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(x_.data()) + 63) & ~uintptr_t(63)); }
    float* res_buffer() { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(res_.data()) + 63) & ~uintptr_t(63)); }

    // the call, word by word, so that a helper reading it while the next call is posted reads
    // atomics (and then sees the claim word's tag change: it drops what it read)
    void store_job(const Job& job, uint64_t gen, int64_t res_per_panel) {
        Posted posted{job, gen, res_per_panel};
        uint64_t w[POSTED_WORDS] = {};
        std::memcpy(w, &posted, sizeof posted);
        for (int i = 0; i < POSTED_WORDS; ++i) posted_[i].store(w[i], std::memory_order_relaxed);
    }
    Posted load_job() const {
        uint64_t w[POSTED_WORDS];
        for (int i = 0; i < POSTED_WORDS; ++i) w[i] = posted_[i].load(std::memory_order_relaxed);
        Posted posted;
        std::memcpy(&posted, w, sizeof posted);
        return posted;
    }

    void futex_wake() { syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0); }

    // until seq_ moves past `seen`, asleep on the futex: no spin (a spinning helper takes CPU time
    // from the caller it shares a CPU with, and under a CPU quota spends the caller's quota)
    void wait_past(uint32_t seen) {
        if (seq_.load(std::memory_order_acquire) != seen) return;
        sleeping_.store(1, std::memory_order_seq_cst);
        while (seq_.load(std::memory_order_seq_cst) == seen)
            syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
        sleeping_.store(0, std::memory_order_relaxed);
    }

    void loop(uint32_t seen) {
        pthread_setname_np(pthread_self(), "polyserve-helpr");  // top, py-spy: 15 characters at most
        for (;;) {
            wait_past(seen);
            if (stop_.load(std::memory_order_seq_cst)) return;
            seen = seq_.load(std::memory_order_acquire);
            uint64_t c = claim_.load(std::memory_order_acquire);
            if ((c & 0xFFFFFFFFu) == CLOSED) continue;
            const Posted posted = load_job();
            std::atomic_thread_fence(std::memory_order_acquire);
            const uint64_t tag = c >> 32;
            if (claim_.load(std::memory_order_relaxed) >> 32 != tag) continue;  // a newer call: read it again
            const uint8_t* xb = x_buffer();
            float* res = res_buffer();
            for (;;) {
                c = claim_.load(std::memory_order_relaxed);
                if (c >> 32 != tag || static_cast<int64_t>(c & 0xFFFFFFFFu) >= posted.job.panels) break;
                if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
                const int64_t p = static_cast<int64_t>(c & 0xFFFFFFFFu);
                if (const int64_t pause = pause_ns_.load(std::memory_order_relaxed)) {
                    const timespec ts{static_cast<time_t>(pause / 1000000000), static_cast<long>(pause % 1000000000)};
                    nanosleep(&ts, nullptr);
                }
                posted.job.sums(p, xb, res + p * posted.res_per_panel);
                done_[p].store(posted.gen, std::memory_order_release);
            }
        }
    }

    std::atomic<bool> enabled_{false}, busy_{false}, stop_{false};
    std::atomic<uint32_t> seq_{0};  // the futex word: one more for each call posted
    std::atomic<int> sleeping_{0};
    std::atomic<int64_t> pause_ns_{0};
    std::atomic<uint64_t> taken_{0};
    std::atomic<uint64_t> claim_{CLOSED};  // the call's tag (its generation's low 32 bits) << 32 | next panel
    std::atomic<uint64_t> posted_[POSTED_WORDS] = {};
    std::vector<std::atomic<uint64_t>> done_;  // per panel: the generation whose sums res holds
    std::vector<uint8_t> x_;
    std::vector<float> res_;
    uint64_t gen_ = 0;  // calls posted (changed under busy_ only)
    std::thread thread_;
};

// A kernel's start / stop entry point: started with buffers for x of up to x_bytes, results of up
// to res_floats floats, `panels` panels, where x_bytes > 0; stopped (joined) where 0. Returns 0, or
// -1 where the thread could not start.
template <class Job>
int start_or_stop(PanelHelper<Job>& helper, int64_t x_bytes, int64_t res_floats, int64_t panels) {
    if (x_bytes <= 0) {
        helper.stop();
        return 0;
    }
    return helper.start(static_cast<size_t>(x_bytes), static_cast<size_t>(res_floats), panels) ? 0 : -1;
}

}  // namespace polyserve
