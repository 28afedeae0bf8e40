// The "collectives" backend of torch.distributed: a c10d::Backend over the
// library's C ABI (collectives.h), the shape of torch's ProcessGroupGloo and
// of Intel's oneCCL bindings. torch registers, names and wraps it like its
// own backends, so functional collectives, torch.compile, DeviceMesh,
// DTensor, FSDP, TorchRec and TORCH_DISTRIBUTED_DEBUG find it as they find
// Gloo, and DDP's autograd thread calls it without the GIL.
//
// It translates, nothing more: each method checks its tensors, describes
// the call as a collCall_t, starts it (collStart) and returns a Work that
// waits on the request. Shapes, counts across ranks, in-place rules and
// every error are the library's. The C symbols come from the package's own
// extension module (collectives._native), so there is one library in the
// process.

#include <pybind11/chrono.h>
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives.h"

namespace collectives_torch {

using c10d::OpType;

// ---- errors: the library's message, with its kind ----

[[noreturn]] void raise(collResult_t code, const std::string& message) {
  if (code == collInvalidArgument) {
    TORCH_CHECK_VALUE(false, message);
  }
  C10_THROW_ERROR(DistBackendError, message);
}

std::exception_ptr failure(collResult_t code, const std::string& message) {
  try {
    raise(code, message);
  } catch (...) {
    return std::current_exception();
  }
}

// ---- tensors and reductions as the C ABI names them ----

std::string where(const char* call) {
  return std::string("collectives backend: ") + call + ": ";
}

// CPU, dense and contiguous: the library reads and writes the tensor's
// memory as one block.
void checkTensor(const at::Tensor& t, const char* call) {
  TORCH_CHECK_VALUE(
      t.device().is_cpu(),
      where(call),
      "the collectives backend runs on CPU tensors, not ",
      t.device(),
      " (use the \"cpu:collectives\" backend for CPU tensors and another for ",
      t.device().type(),
      ")");
  TORCH_CHECK_VALUE(
      t.layout() == c10::kStrided,
      where(call),
      "a ",
      t.layout(),
      " tensor: the collectives backend takes dense tensors only");
  TORCH_CHECK_VALUE(
      t.numel() == 0 || (t.has_storage() && t.data_ptr() != nullptr),
      where(call),
      "the tensor has no memory of its own (a tensor subclass such as ",
      "AsyncCollectiveTensor: wait for it first)");
  TORCH_CHECK_VALUE(
      t.is_contiguous(),
      where(call),
      "the tensor is not contiguous (sizes ",
      t.sizes(),
      ", strides ",
      t.strides(),
      "): call .contiguous() on it first");
}

collDataType_t dataType(const at::Tensor& t, const char* call) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return collFloat32;
    case at::kDouble:
      return collFloat64;
    case at::kHalf:
      return collFloat16;
    case at::kBFloat16:
      return collBfloat16;
    case at::kChar:
      return collInt8;
    case at::kByte:
    case at::kBool:
    case at::kFloat8_e4m3fn:
    case at::kFloat8_e5m2:
      return collUint8;
    case at::kInt:
      return collInt32;
    case at::kUInt32:
      return collUint32;
    case at::kLong:
      return collInt64;
    case at::kUInt64:
      return collUint64;
    default:
      TORCH_CHECK_VALUE(
          false,
          where(call),
          "no datatype for ",
          t.scalar_type(),
          " (float32/64, float16, bfloat16, int8/32/64, uint8/32/64, bool)");
  }
}

// Bytes moved as bytes: dtypes the library has no reduction for (bool,
// float8, complex) still broadcast, gather and exchange.
bool isRaw(const at::Tensor& t) {
  return t.scalar_type() == at::kBool || t.is_complex() ||
      t.scalar_type() == at::kFloat8_e4m3fn ||
      t.scalar_type() == at::kFloat8_e5m2;
}

// (datatype, count) for a call that only moves the tensor's bytes.
std::pair<collDataType_t, size_t> asBytes(const at::Tensor& t, const char* call) {
  if (isRaw(t) || t.is_complex()) {
    return {collUint8, static_cast<size_t>(t.numel() * t.element_size())};
  }
  return {dataType(t, call), static_cast<size_t>(t.numel())};
}

const char* redOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    default:
      return "(unknown)";
  }
}

// The library's reduction for torch's. Bool reduces as uint8 with max/min
// for sum/product (logical or/and, as NCCL does); complex sums as pairs of
// reals.
collRedOp_t reduction(const c10d::ReduceOp& op, const at::Tensor& t, const char* call) {
  const bool logical = t.scalar_type() == at::kBool;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PREMUL_SUM:
      return logical ? collMax : collSum;
    case c10d::ReduceOp::PRODUCT:
      return logical ? collMin : collProd;
    case c10d::ReduceOp::MIN:
      return collMin;
    case c10d::ReduceOp::MAX:
      return collMax;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK_VALUE(!logical, where(call), "AVG of a bool tensor");
      return collAvg;
    default:
      TORCH_CHECK_VALUE(
          false,
          where(call),
          "the collectives backend has no reduction ",
          redOpName(op.op_),
          " (it has SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM)");
  }
}

// A reducing call on `t`: datatype, count and reduction (complex: its
// real and imaginary parts, for sum and average only).
struct Reducing {
  collDataType_t type;
  size_t count;
  collRedOp_t op;
};

Reducing reducing(const at::Tensor& t, const c10d::ReduceOp& op, const char* call) {
  if (t.is_complex()) {
    const auto r = at::view_as_real(t);
    const auto red = reduction(op, r, call);
    TORCH_CHECK_VALUE(
        red == collSum || red == collAvg,
        where(call),
        "complex tensors reduce by SUM or AVG only");
    return {dataType(r, call), static_cast<size_t>(r.numel()), red};
  }
  return {dataType(t, call), static_cast<size_t>(t.numel()), reduction(op, t, call)};
}

// PREMUL_SUM multiplies by its factor before summing (in place on the
// input, which the call overwrites anyway or owns).
void premultiply(const c10d::ReduceOp& op, at::Tensor& t) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) {
    return;
  }
  const auto* s = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK_VALUE(s != nullptr, "PREMUL_SUM without its factor");
  if (s->tensor_factor.defined()) {
    t.mul_(s->tensor_factor.to(t.device()));
  } else {
    t.mul_(s->double_factor);
  }
}

collCall_t callOf(collCallType_t type) {
  collCall_t c{};
  c.call = type;
  return c;
}

// ---- completion of futures, off the library's threads ----

// The library calls a request's callback on its own thread, where user code
// must not run (a future's callbacks may take the GIL or start calls): it
// hands the work to this thread, one per process.
class Completer {
 public:
  static Completer& get() {
    static Completer* c = new Completer(); // never freed: outlives every Work
    return *c;
  }

  void push(std::function<void()>* task) {
    {
      std::lock_guard<std::mutex> g(m_);
      q_.push_back(task);
    }
    cv_.notify_one();
  }

  // At interpreter exit: what is left is left to the OS (running it could
  // touch a finalized interpreter).
  void stop() {
    std::lock_guard<std::mutex> g(m_);
    stopped_ = true;
  }

 private:
  Completer() {
    std::thread([this] { run(); }).detach();
  }

  void run() {
    for (;;) {
      std::function<void()>* task;
      {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [this] { return !q_.empty(); });
        task = q_.front();
        q_.pop_front();
        if (stopped_) {
          continue;
        }
      }
      try {
        (*task)();
      } catch (const std::exception& e) {
        TORCH_WARN("collectives backend: a completion failed: ", e.what());
      }
      delete task;
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>*> q_;
  bool stopped_ = false;
};

extern "C" void onRequestDone(void* arg, collResult_t /*result*/) {
  Completer::get().push(static_cast<std::function<void()>*>(arg));
}

// Has `task` run on the completer once `request` ended.
void whenDone(collRequest_t request, std::function<void()> task) {
  auto* t = new std::function<void()>(std::move(task));
  if (collRequestOnDone(request, onRequestDone, t) != collSuccess) {
    delete t;
    TORCH_CHECK(false, "collectives backend: collRequestOnDone failed");
  }
}

// ---- Work: the requests of one torch call ----

class WorkCollectives : public c10d::Work {
 public:
  WorkCollectives(
      int rank,
      OpType type,
      const char* title,
      const std::vector<at::Tensor>& inputs,
      std::vector<at::Tensor> keep,
      std::vector<at::Tensor> outputs,
      std::function<void()> then,
      int source = -1)
      : Work(rank, type, title, std::optional<std::vector<at::Tensor>>(inputs)),
        keep_(std::move(keep)),
        outputs_(std::move(outputs)),
        then_(std::move(then)),
        source_(source) {}

  ~WorkCollectives() override {
    // A Work dropped while its calls run (an isend nobody waits on): the
    // tensors stay alive until the last call ended.
    std::vector<collRequest_t> running;
    for (auto r : requests_) {
      int done = 1;
      collRequestTest(r, &done);
      if (done) {
        collRequestFree(r);
      } else {
        running.push_back(r);
      }
    }
    if (running.empty()) {
      return;
    }
    auto left = std::make_shared<Leftover>(std::move(keep_), running);
    for (auto r : running) {
      whenDone(r, [left] {});
    }
  }

  void add(collRequest_t r) {
    requests_.push_back(r);
  }

  bool isCompleted() override {
    for (auto r : requests_) {
      int done = 0;
      collRequestTest(r, &done);
      if (!done) {
        return false;
      }
    }
    settle();
    return true;
  }

  bool isSuccess() const override {
    std::lock_guard<std::mutex> g(mutex_);
    return completed_ && !exception_;
  }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> g(mutex_);
    return exception_;
  }

  int sourceRank() const override {
    TORCH_CHECK(source_ >= 0, "sourceRank() is known only for a receive from any source");
    return source_;
  }

  void setSource(int source) {
    source_ = source;
  }

  std::vector<at::Tensor> result() override {
    return outputs_;
  }

  void synchronize() override {}

  // A timeout of the call's own (a torch option such as barrier's
  // `timeout=`), and how to end what is in flight when it expires.
  void setTimeout(std::chrono::milliseconds timeout, std::function<void(const std::string&)> revoke) {
    timeout_ = timeout;
    revoke_ = std::move(revoke);
  }

  // Waits for every request (driving them on this thread: the fastest
  // way), or up to `timeout` (else the call's own); throws the first
  // failure. A call that runs out of time takes its process group down
  // with it, as NCCL's watchdog does: the ranks it waits for never came,
  // and torch's callers expect to destroy or rebuild the group then.
  bool wait(std::chrono::milliseconds timeout) override {
    const auto limit = timeout.count() > 0 ? timeout : timeout_;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (auto r : requests_) {
      int ms = -1;
      if (limit.count() > 0) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        ms = static_cast<int>(std::max<int64_t>(0, left.count()));
      }
      if (collRequestWait(r, ms) == collInProgress) {
        const std::string what = "Timed out waiting " + std::to_string(limit.count()) + "ms for " +
            c10d::opTypeToString(retrieveOpType()) + " (rank " + std::to_string(rank_) + ")";
        if (revoke_) {
          revoke_(what);
        }
        for (auto q : requests_) {
          collRequestWait(q, -1); // ended at once by the revoke
        }
        raise(collTimeout, "collectives backend: " + what + "; the process group was aborted");
      }
    }
    settle();
    std::lock_guard<std::mutex> g(mutex_);
    if (exception_) {
      std::rethrow_exception(exception_);
    }
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> g(futureMutex_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()));
      pending_ = static_cast<int>(requests_.size());
      // Each callback holds a reference: the Work outlives its calls.
      for (auto r : requests_) {
        auto self = c10::intrusive_ptr<WorkCollectives>::reclaim_copy(this);
        whenDone(r, [self] {
          if (--self->pending_ == 0) {
            self->settle();
            std::lock_guard<std::mutex> g(self->futureMutex_);
            self->completeFuture();
          }
        });
      }
      // Done already (waited for, or run at once): complete it now.
      completeFuture();
    }
    return future_;
  }

  void abort() override {
    TORCH_CHECK(false, "collectives backend: abort the process group (ProcessGroup.abort()), not one Work");
  }

 private:
  // What a dropped Work leaves until its calls ended.
  struct Leftover {
    Leftover(std::vector<at::Tensor> k, std::vector<collRequest_t> r)
        : keep(std::move(k)), requests(std::move(r)) {}
    ~Leftover() {
      for (auto r : requests) {
        collRequestFree(r);
      }
    }
    std::vector<at::Tensor> keep;
    std::vector<collRequest_t> requests;
  };

  // Once every request ended: the first failure, or the unpacking copies;
  // then the Work and its future complete (once, whoever gets here first).
  void settle() {
    std::lock_guard<std::mutex> once(settleMutex_);
    if (settled_) {
      return;
    }
    std::exception_ptr error;
    for (auto r : requests_) {
      const collResult_t code = collRequestWait(r, 0);
      if (code != collSuccess && !error) {
        error = failure(code, collRequestGetError(r));
      }
    }
    if (!error && then_) {
      try {
        then_();
      } catch (...) {
        error = std::current_exception();
      }
    }
    finish(error);
    settled_ = true;
    std::lock_guard<std::mutex> g(futureMutex_);
    if (future_) {
      completeFuture();
    }
  }

  // (futureMutex_ held)
  void completeFuture() {
    if (future_->completed()) {
      return;
    }
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> g(mutex_);
      if (!completed_) {
        return; // settle() completes it
      }
      error = exception_;
    }
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

  std::vector<collRequest_t> requests_;
  std::vector<at::Tensor> keep_;
  std::vector<at::Tensor> outputs_;
  std::function<void()> then_;
  int source_;
  std::chrono::milliseconds timeout_{0};
  std::function<void(const std::string&)> revoke_;
  std::mutex settleMutex_;
  bool settled_ = false;
  std::mutex futureMutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> pending_{0};
};

// ---- the backend ----

// Calls that make up one torch call, what they use, and the copies
// that finish it.
struct Plan {
  std::vector<collCall_t> calls;
  std::vector<at::Tensor> keep;
  std::function<void()> then;
};

// How torch wants a call run: waited for at once or not, and its own
// timeout (unset: the group's).
struct How {
  bool async = true;
  std::chrono::milliseconds timeout{-1};
};


class BackendCollectives : public c10d::Backend {
 public:
  BackendCollectives(collComm_t comm, int rank, int size, std::chrono::milliseconds timeout)
      : Backend(rank, size),
        comm_(comm),
        options_(c10::make_intrusive<Options>("collectives", timeout)) {}

  ~BackendCollectives() override {
    shutdown();
  }

  // Joins the group whose members meet in `store`: its rank 0 makes a
  // unique id and publishes it there. `timeout` becomes the library's
  // (nothing moved for that long: the call fails) unless COLL_TIMEOUT says.
  static c10::intrusive_ptr<BackendCollectives> create(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout) {
    const std::string key = "collectives/unique_id";
    collUniqueId id{};
    if (rank == 0) {
      check(collGetUniqueId(&id), nullptr, "collGetUniqueId");
      const auto* b = reinterpret_cast<const uint8_t*>(id.internal);
      store->set(key, std::vector<uint8_t>(b, b + sizeof(id.internal)));
    } else {
      const auto got = store->get(key);
      TORCH_CHECK(got.size() == sizeof(id.internal), "collectives backend: a bad unique id in the store");
      std::memcpy(id.internal, got.data(), got.size());
    }
    collConfig_t config = COLL_CONFIG_INITIALIZER;
    if (std::getenv("COLL_TIMEOUT") == nullptr) {
      config.timeoutMs = static_cast<int>(std::min<int64_t>(timeout.count(), INT32_MAX));
    }
    collComm_t comm = nullptr;
    check(collCommInitRankConfig(&comm, size, id, rank, &config), nullptr, "collCommInitRankConfig");
    return c10::make_intrusive<BackendCollectives>(comm, rank, size, timeout);
  }

  const std::string getBackendName() const override {
    return "collectives";
  }

  c10::intrusive_ptr<Options> getBackendOptions() override {
    return options_;
  }

  // ---- collectives ----

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    if (tensors.size() == 1 && tensors[0].is_sparse()) {
      return allreduce_sparse(tensors, opts);
    }
    auto& t = one(tensors, "allreduce");
    const auto r = reducing(t, opts.reduceOp, "allreduce");
    premultiply(opts.reduceOp, t);
    return start(OpType::ALLREDUCE, "collectives:all_reduce", tensors, {{reduce(collCallAllReduce, t, r)}, tensors}, tensors, how(opts));
  }

  // A sparse (COO) tensor's sum, as Gloo computes it: every rank's
  // indices and values gathered (AllGather of the counts, then AllToAllv),
  // summed by coalescing; the tensor takes the result. Runs here, at once.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    TORCH_CHECK_VALUE(tensors.size() == 1, where("allreduce_sparse"), "one tensor per call");
    auto& t = tensors[0];
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.layout() == c10::kSparse, where("allreduce_sparse"),
                      "a sparse COO CPU tensor, not ", t.layout(), " on ", t.device());
    TORCH_CHECK_VALUE(opts.reduceOp.op_ == c10d::ReduceOp::SUM, where("allreduce_sparse"), "sparse tensors reduce by SUM only");
    auto in = t.coalesce();
    auto indices = in._indices().t().contiguous(); // one row per nonzero
    auto values = in._values().contiguous();
    auto counts = at::empty({size_}, at::kLong);
    auto mine = at::full({1}, indices.size(0), at::kLong);
    runHere(moving(collCallAllGather, mine, counts, "allreduce_sparse"), "allreduce_sparse");
    auto all = at::sparse_coo_tensor(gatherRows(indices, counts).t(), gatherRows(values, counts), t.sizes());
    t.copy_(all.coalesce());
    return start(OpType::_ALLREDUCE_SPARSE, "collectives:all_reduce_sparse", tensors, {}, tensors);
  }

  // Every rank's `rows` (leading dim `counts[r]` on rank r), one after
  // another in rank order.
  at::Tensor gatherRows(const at::Tensor& rows, const at::Tensor& counts) {
    auto shape = rows.sizes().vec();
    const int64_t row = c10::multiply_integers(shape.begin() + 1, shape.end());
    shape[0] = counts.sum().item<int64_t>();
    auto out = at::empty(shape, rows.options());
    Blocks v(size_);
    v.sendCounts.assign(size_, static_cast<size_t>(rows.numel()));
    const auto* c = counts.data_ptr<int64_t>();
    for (int r = 0, at = 0; r < size_; at += c[r] * row, ++r) {
      v.recvCounts[r] = static_cast<size_t>(c[r] * row);
      v.recvDispls[r] = static_cast<size_t>(at);
    }
    runHere(v.call(rows, out, "allreduce_sparse"), "allreduce_sparse");
    return out;
  }

  // Gloo's monitored barrier: every rank checks in with rank 0, which
  // waits up to the timeout for each and names the ranks that did not
  // come (the first, or with `waitAllRanks` all of them), then lets the
  // others go. A failure aborts the group, whose calls would wait for those
  // ranks too.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    using namespace std::chrono;
    const auto timeout = opts.timeout == c10d::kUnsetTimeout ? options_->timeout : opts.timeout;
    const auto began = steady_clock::now();
    auto token = [] { return at::zeros({1}, at::kByte); };
    std::vector<at::Tensor> tokens;
    auto post = [&](collCallType_t type, int peer) {
      tokens.push_back(token());
      auto c = moving(type, tokens.back(), tokens.back(), "monitored_barrier");
      c.peer = peer;
      std::shared_lock<std::shared_mutex> g(lock_);
      collRequest_t r = nullptr;
      check(collStart(live(), &c, &r), comm_, "monitored_barrier");
      return r;
    };
    auto fail = [&](std::vector<collRequest_t>& rs, const std::string& why) {
      revoke(why);
      for (auto r : rs) {
        collRequestWait(r, -1);
        collRequestFree(r);
      }
      TORCH_CHECK(false, why);
    };
    if (rank_ != 0) {
      std::vector<collRequest_t> rs{post(collCallSend, 0), post(collCallRecv, 0)};
      for (auto r : rs) {
        const auto code = collRequestWait(r, static_cast<int>(std::max<int64_t>(0, timeout.count())));
        if (code != collSuccess) {
          fail(rs, "Rank " + std::to_string(rank_) + " successfully reached monitoredBarrier, but received errors "
               "while waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank. (" +
               (code == collInProgress ? "Timed out waiting " + std::to_string(timeout.count()) + "ms" : std::string(collRequestGetError(r))) + ")");
        }
      }
      for (auto r : rs) {
        collRequestFree(r);
      }
      return;
    }
    // One rank at a time, as Gloo: a rank 0 out of time has nothing in
    // flight to abort.
    std::vector<collRequest_t> rs;
    std::vector<int> passed, failed;
    for (int r = 1; r < size_; ++r) {
      auto left = waitAllRanks ? timeout : timeout - duration_cast<milliseconds>(steady_clock::now() - began);
      if (!waitAllRanks && left.count() <= 0) {
        for (auto q : rs) {
          collRequestFree(q);
        }
        TORCH_CHECK(false, "Rank 0 timed out in monitoredBarrier after ", timeout.count(),
                    " ms. Successfully processed ranks: ", join(passed));
      }
      rs.push_back(post(collCallRecv, r));
      if (collRequestWait(rs.back(), static_cast<int>(left.count())) == collSuccess) {
        passed.push_back(r);
        continue;
      }
      failed.push_back(r);
      if (!waitAllRanks) {
        fail(rs, "[Rank 0]: Rank " + std::to_string(r) + " failed to pass monitoredBarrier in " +
             std::to_string(timeout.count()) + " ms");
      }
    }
    if (!failed.empty()) {
      fail(rs, "[Rank 0]: Ranks " + join(failed) + " failed to pass monitoredBarrier in " +
           std::to_string(timeout.count()) + " ms");
    }
    for (int r = 1; r < size_; ++r) {
      rs.push_back(post(collCallSend, r));
    }
    for (auto r : rs) {
      collRequestWait(r, -1);
      collRequestFree(r);
    }
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    std::vector<collCall_t> calls;
    for (auto& t : tensors) {
      checkTensor(t, "allreduce_coalesced");
      const auto r = reducing(t, opts.reduceOp, "allreduce_coalesced");
      premultiply(opts.reduceOp, t);
      calls.push_back(reduce(collCallAllReduce, t, r));
    }
    return start(OpType::ALLREDUCE_COALESCED, "collectives:all_reduce_coalesced", tensors, {calls, tensors}, tensors, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    auto& t = one(tensors, "broadcast");
    auto c = moving(collCallBroadcast, t, t, "broadcast");
    c.peer = rootOf(opts.rootRank, opts.rootTensor, "broadcast");
    return start(OpType::BROADCAST, "collectives:broadcast", tensors, {{c}, tensors}, tensors, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    auto& t = one(tensors, "reduce");
    const auto r = reducing(t, opts.reduceOp, "reduce");
    premultiply(opts.reduceOp, t);
    auto c = reduce(collCallReduce, t, r);
    c.peer = rootOf(opts.rootRank, opts.rootTensor, "reduce");
    return start(OpType::REDUCE, "collectives:reduce", tensors, {{c}, tensors}, tensors, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    auto& in = one(inputs, "allgather");
    auto plan = gatherInto(oneList(outputs, "allgather"), in);
    return start(OpType::ALLGATHER, "collectives:all_gather", inputs, plan, outputs[0], how(opts));
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    checkTensor(output, "all_gather_into_tensor");
    checkTensor(input, "all_gather_into_tensor");
    sameType(output, input, "all_gather_into_tensor");
    auto c = moving(collCallAllGather, input, output, "all_gather_into_tensor");
    return start(OpType::_ALLGATHER_BASE, "collectives:all_gather_into_tensor", {input}, {{c}, {input, output}}, {output}, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    // outputs[r][i] is rank r's inputs[i].
    TORCH_CHECK_VALUE(
        static_cast<int>(outputs.size()) == size_,
        where("allgather_coalesced"),
        outputs.size(),
        " output lists for ",
        size_,
        " ranks");
    Plan all;
    std::vector<std::function<void()>> thens;
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkTensor(inputs[i], "allgather_coalesced");
      std::vector<at::Tensor> outs;
      for (auto& list : outputs) {
        TORCH_CHECK_VALUE(list.size() == inputs.size(), where("allgather_coalesced"), "an output list of ",
                          list.size(), " tensors for ", inputs.size(), " inputs");
        outs.push_back(list[i]);
      }
      auto plan = gatherInto(outs, inputs[i]);
      all.calls.insert(all.calls.end(), plan.calls.begin(), plan.calls.end());
      all.keep.insert(all.keep.end(), plan.keep.begin(), plan.keep.end());
      if (plan.then) {
        thens.push_back(plan.then);
      }
    }
    all.then = [thens] {
      for (auto& t : thens) {
        t();
      }
    };
    return start(OpType::ALLGATHER_COALESCED, "collectives:all_gather_coalesced", inputs, all, flatten(outputs), how(opts));
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    std::vector<collCall_t> calls;
    for (size_t i = 0; i < pairs(outputs, inputs, "allgather_into_tensor_coalesced"); ++i) {
      sameType(outputs[i], inputs[i], "allgather_into_tensor_coalesced");
      calls.push_back(moving(collCallAllGather, inputs[i], outputs[i], "allgather_into_tensor_coalesced"));
    }
    return start(
        OpType::ALLGATHER_INTO_TENSOR_COALESCED,
        "collectives:all_gather_into_tensor_coalesced",
        inputs,
        {calls, concat(inputs, outputs)},
        outputs,
        how(opts));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    auto& out = one(outputs, "reduce_scatter");
    auto& ins = oneList(inputs, "reduce_scatter");
    TORCH_CHECK_VALUE(
        static_cast<int>(ins.size()) == size_,
        where("reduce_scatter"),
        ins.size(),
        " inputs for ",
        size_,
        " ranks");
    for (auto& t : ins) {
      checkTensor(t, "reduce_scatter");
      sameType(t, out, "reduce_scatter");
      TORCH_CHECK_VALUE(t.numel() == out.numel(), where("reduce_scatter"), "every input must have the output's size");
    }
    auto packed = at::cat(flatAll(ins));
    premultiply(opts.reduceOp, packed);
    auto c = reduceScatter(packed, out, opts.reduceOp, "reduce_scatter");
    return start(OpType::REDUCE_SCATTER, "collectives:reduce_scatter", inputs[0], {{c}, {packed, out}}, outputs, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    checkTensor(input, "reduce_scatter_tensor");
    premultiply(opts.reduceOp, input);
    auto c = reduceScatter(input, output, opts.reduceOp, "reduce_scatter_tensor");
    return start(OpType::_REDUCE_SCATTER_BASE, "collectives:reduce_scatter_tensor", {input}, {{c}, {input, output}}, {output}, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    std::vector<collCall_t> calls;
    for (size_t i = 0; i < pairs(outputs, inputs, "reduce_scatter_tensor_coalesced"); ++i) {
      premultiply(opts.reduceOp, inputs[i]);
      calls.push_back(reduceScatter(inputs[i], outputs[i], opts.reduceOp, "reduce_scatter_tensor_coalesced"));
    }
    return start(
        OpType::REDUCE_SCATTER_TENSOR_COALESCED,
        "collectives:reduce_scatter_tensor_coalesced",
        inputs,
        {calls, concat(inputs, outputs)},
        outputs,
        how(opts));
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts) override {
    checkTensor(output, "all_to_all_single");
    checkTensor(input, "all_to_all_single");
    sameType(output, input, "all_to_all_single");
    if (outputSplits.empty() && inputSplits.empty()) {
      TORCH_CHECK_VALUE(
          input.numel() % size_ == 0,
          where("all_to_all_single"),
          "the input's ",
          input.numel(),
          " elements do not split evenly among ",
          size_,
          " ranks");
      auto c = moving(collCallAllToAll, input, output, "all_to_all_single");
      c.count /= size_;
      return start(OpType::ALLTOALL_BASE, "collectives:all_to_all", {input}, {{c}, {input, output}}, {output}, how(opts));
    }
    Blocks v;
    v.fill(input, inputSplits, size_, v.sendCounts, v.sendDispls, "all_to_all_single input");
    v.fill(output, outputSplits, size_, v.recvCounts, v.recvDispls, "all_to_all_single output");
    auto c = v.call(input, output, "all_to_all_single");
    return start(OpType::ALLTOALL_BASE, "collectives:all_to_all", {input}, {{c}, {input, output}}, {output}, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    TORCH_CHECK_VALUE(
        static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
        where("all_to_all"),
        "one input and one output tensor per rank (",
        size_,
        ")");
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkTensor(inputs[i], "all_to_all");
      checkTensor(outputs[i], "all_to_all");
      sameType(inputs[i], outputs[i], "all_to_all");
    }
    auto send = at::cat(flatAll(inputs));
    auto recv = at::empty({totalNumel(outputs)}, outputs[0].options());
    Blocks v;
    v.packed(inputs, v.sendCounts, v.sendDispls);
    v.packed(outputs, v.recvCounts, v.recvDispls);
    auto c = v.call(send, recv, "all_to_all");
    auto outs = outputs;
    return start(OpType::ALLTOALL, "collectives:all_to_all", inputs, {{c}, {send, recv}, [recv, outs] { unpack(recv, outs); }}, outputs, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    auto& in = one(inputs, "gather");
    const int root = rootOf(opts.rootRank, 0, "gather");
    const bool me = root == rank_;
    std::vector<at::Tensor> outs;
    if (me) {
      outs = oneList(outputs, "gather");
      TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == size_, where("gather"), "the root needs one output per rank");
    } else {
      TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), where("gather"), "only the root takes outputs");
    }
    // Everyone sends its input to the root, which receives one block each.
    auto flatIn = in.reshape(-1);
    auto recv = at::empty({me ? totalNumel(outs) : 0}, in.options());
    Blocks v(size_);
    v.sendCounts[root] = in.numel();
    if (me) {
      v.packed(outs, v.recvCounts, v.recvDispls);
    }
    auto c = v.call(flatIn, recv, "gather");
    return start(OpType::GATHER, "collectives:gather", inputs, {{c}, {flatIn, recv}, [recv, outs] { unpack(recv, outs); }}, outs, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    auto& out = one(outputs, "scatter");
    const int root = rootOf(opts.rootRank, 0, "scatter");
    const bool me = root == rank_;
    at::Tensor send = at::empty({0}, out.options());
    Blocks v(size_);
    if (me) {
      auto& ins = oneList(inputs, "scatter");
      TORCH_CHECK_VALUE(static_cast<int>(ins.size()) == size_, where("scatter"), "the root needs one input per rank");
      for (auto& t : ins) {
        checkTensor(t, "scatter");
        sameType(t, out, "scatter");
      }
      send = at::cat(flatAll(ins));
      v.packed(ins, v.sendCounts, v.sendDispls);
    } else {
      TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), where("scatter"), "only the root takes inputs");
    }
    v.recvCounts[root] = out.numel();
    auto flatOut = out.view(-1);
    auto c = v.call(send, flatOut, "scatter");
    return start(OpType::SCATTER, "collectives:scatter", inputs.empty() ? std::vector<at::Tensor>{} : inputs[0], {{c}, {send, out}}, outputs, how(opts));
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return start(OpType::BARRIER, "collectives:barrier", {}, {{callOf(collCallBarrier)}}, {}, how(opts));
  }

  // ---- point-to-point ----

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto& t = one(tensors, "send");
    auto c = moving(collCallSend, t, t, "send");
    c.recvbuff = nullptr;
    c.peer = dst;
    return start(OpType::SEND, "collectives:send", tensors, {{c}, tensors}, tensors);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto& t = one(tensors, "recv");
    auto c = moving(collCallRecv, t, t, "recv");
    c.sendbuff = nullptr;
    c.peer = src;
    auto w = start(OpType::RECV, "collectives:recv", tensors, {{c}, tensors}, tensors);
    w->setSource(src);
    return w;
  }

  // ---- groups: split, shrink, failed ranks ----

  bool supportsSplitting() const override {
    return true;
  }

  // The members of `ranks` (sorted, group ranks) form the child; every rank
  // of this group calls it (the library's split, no store).
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& /*store*/,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override {
    const auto at = std::find(ranks.begin(), ranks.end(), rank_);
    const bool member = at != ranks.end();
    const int color = member ? ranks.front() : -1;
    const int key = member ? static_cast<int>(at - ranks.begin()) : 0;
    collComm_t child = nullptr;
    {
      std::shared_lock<std::shared_mutex> g(lock_);
      check(collCommSplit(live(), color, key, &child), comm_, "split");
    }
    if (child == nullptr) {
      return nullptr;
    }
    int childRank = 0, childSize = 0;
    collCommUserRank(child, &childRank);
    collCommCount(child, &childSize);
    auto timeout = opts ? opts->timeout : options_->timeout;
    auto made = c10::make_intrusive<BackendCollectives>(child, childRank, childSize, timeout);
    if (opts) {
      made->options_->group_name = opts->group_name;
    }
    return made;
  }

  bool supportsShrinking() const override {
    return true;
  }

  // The ranks not excluded (every one of them calls it), on a communicator
  // of their own; flag 1 (SHRINK_ABORT) first ends what is in flight.
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& exclude,
      int flags,
      const c10::intrusive_ptr<Options>& opts) override {
    std::vector<int> ranks(exclude.begin(), exclude.end());
    collComm_t child = nullptr;
    {
      std::shared_lock<std::shared_mutex> g(lock_);
      const int how = (flags & 1) ? COLL_SHRINK_ABORT : COLL_SHRINK_DEFAULT;
      check(collCommShrink(live(), ranks.data(), ranks.size(), &child, nullptr, how), comm_, "shrink");
    }
    int childRank = 0, childSize = 0;
    collCommUserRank(child, &childRank);
    collCommCount(child, &childSize);
    return c10::make_intrusive<BackendCollectives>(child, childRank, childSize, options_->timeout);
  }

  // The ranks of this group that failed, the same list on every survivor
  // (each must call it): what dist.shrink_group takes.
  std::vector<int> failedRanks() {
    std::shared_lock<std::shared_mutex> g(lock_);
    std::vector<int> failed(size_);
    int count = 0;
    check(collCommGetFailedRanks(live(), failed.data(), size_, &count), comm_, "failed_ranks");
    failed.resize(count);
    return failed;
  }

  // ---- lifetime ----

  // Ends every call in flight, in any thread, and every later one; the
  // peers are told. The communicator is freed at shutdown.
  void abort() override {
    revoke("rank " + std::to_string(rank_) + " aborted its process group");
  }

  // Ends every call in flight here and every later one; the peers are told
  // `why`.
  void revoke(const std::string& why) {
    std::shared_lock<std::shared_mutex> g(lock_);
    revoked_ = true;
    if (comm_ != nullptr) {
      collCommRevoke(comm_, why.c_str());
    }
  }

  void shutdown() override {
    std::unique_lock<std::shared_mutex> g(lock_);
    if (comm_ != nullptr) {
      collCommDestroy(comm_);
      comm_ = nullptr;
    }
  }

  c10d::ErrorType getError() override {
    return revoked_ ? c10d::ErrorType::COMM_ERROR : c10d::ErrorType::SUCCESS;
  }

  uint64_t getSequenceNumberForGroup() override {
    return seq_.load();
  }

 private:
  // AllToAllv's blocks, alive until the call ended (the library copies
  // them at the start, but the Work keeps them for simplicity's sake).
  struct Blocks {
    explicit Blocks(int n = 0)
        : sendCounts(n), sendDispls(n), recvCounts(n), recvDispls(n) {}

    // Split sizes (rows of dim 0; empty: even) as element counts, packed.
    void fill(
        const at::Tensor& t,
        const std::vector<int64_t>& splits,
        int n,
        std::vector<size_t>& counts,
        std::vector<size_t>& displs,
        const char* what) {
      const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
      const int64_t row = rows > 0 ? t.numel() / rows : 0;
      std::vector<int64_t> s = splits;
      if (s.empty()) {
        TORCH_CHECK_VALUE(rows % n == 0, where(what), "dim 0 (", rows, ") does not split evenly among ", n, " ranks");
        s.assign(n, rows / n);
      }
      TORCH_CHECK_VALUE(static_cast<int>(s.size()) == n, where(what), s.size(), " split sizes for ", n, " ranks");
      counts.assign(n, 0);
      displs.assign(n, 0);
      size_t at = 0;
      for (int j = 0; j < n; ++j) {
        TORCH_CHECK_VALUE(s[j] >= 0, where(what), "a negative split size");
        counts[j] = static_cast<size_t>(s[j] * row);
        displs[j] = at;
        at += counts[j];
      }
    }

    // One block per tensor, one after another.
    void packed(const std::vector<at::Tensor>& ts, std::vector<size_t>& counts, std::vector<size_t>& displs) {
      counts.assign(ts.size(), 0);
      displs.assign(ts.size(), 0);
      size_t at = 0;
      for (size_t j = 0; j < ts.size(); ++j) {
        counts[j] = static_cast<size_t>(ts[j].numel());
        displs[j] = at;
        at += counts[j];
      }
    }

    collCall_t call(const at::Tensor& send, const at::Tensor& recv, const char* what) {
      auto c = callOf(collCallAllToAllv);
      c.datatype = dataType(send, what);
      c.sendbuff = send.data_ptr();
      c.recvbuff = recv.data_ptr();
      c.sendcounts = sendCounts.data();
      c.sdispls = sendDispls.data();
      c.recvcounts = recvCounts.data();
      c.rdispls = recvDispls.data();
      if (isRaw(send)) { // bytes: scale the blocks
        const size_t e = send.element_size();
        for (auto* v : {&sendCounts, &sendDispls, &recvCounts, &recvDispls}) {
          for (auto& x : *v) {
            x *= e;
          }
        }
        c.datatype = collUint8;
      }
      return c;
    }

    std::vector<size_t> sendCounts, sendDispls, recvCounts, recvDispls;
  };


  template <class O>
  static How how(const O& opts) {
    return {opts.asyncOp, opts.timeout};
  }

  static void check(collResult_t r, collComm_t comm, const char* what) {
    if (r != collSuccess) {
      raise(r, std::string("collectives backend: ") + what + ": " + collGetLastError(comm));
    }
  }

  // Runs `c` on this thread, to its end.
  void runHere(const collCall_t& c, const char* what) {
    std::shared_lock<std::shared_mutex> g(lock_);
    check(collCall(live(), &c), comm_, what);
  }

  static std::string join(const std::vector<int>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) {
      s += (i ? ", " : "") + std::to_string(v[i]);
    }
    return s;
  }

  // The communicator, unless shut down (lock_ held).
  collComm_t live() const {
    TORCH_CHECK(comm_ != nullptr, "collectives backend: the process group was shut down");
    return comm_;
  }

  at::Tensor& one(std::vector<at::Tensor>& tensors, const char* call) {
    TORCH_CHECK_VALUE(tensors.size() == 1, where(call), "one tensor per call (got ", tensors.size(), ")");
    checkTensor(tensors[0], call);
    return tensors[0];
  }

  std::vector<at::Tensor>& oneList(std::vector<std::vector<at::Tensor>>& lists, const char* call) {
    TORCH_CHECK_VALUE(lists.size() == 1, where(call), "one list of tensors per call (got ", lists.size(), ")");
    return lists[0];
  }

  size_t pairs(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& ins, const char* call) {
    TORCH_CHECK_VALUE(outs.size() == ins.size(), where(call), outs.size(), " outputs for ", ins.size(), " inputs");
    for (size_t i = 0; i < ins.size(); ++i) {
      checkTensor(outs[i], call);
      checkTensor(ins[i], call);
    }
    return ins.size();
  }

  static void sameType(const at::Tensor& a, const at::Tensor& b, const char* call) {
    TORCH_CHECK_VALUE(
        a.scalar_type() == b.scalar_type(),
        where(call),
        "tensors of ",
        a.scalar_type(),
        " and ",
        b.scalar_type(),
        ": both must have one dtype");
  }

  int rootOf(int64_t rootRank, int64_t rootTensor, const char* call) {
    TORCH_CHECK_VALUE(rootTensor == 0, where(call), "one tensor per rank (rootTensor must be 0)");
    TORCH_CHECK_VALUE(rootRank >= 0 && rootRank < size_, where(call), "root ", rootRank, " is not a rank of ", size_);
    return static_cast<int>(rootRank);
  }

  // A call that moves `send`'s bytes into `recv`.
  static collCall_t moving(collCallType_t type, const at::Tensor& send, const at::Tensor& recv, const char* call) {
    auto c = callOf(type);
    const auto [dt, count] = asBytes(send, call);
    c.datatype = dt;
    c.count = count;
    c.sendbuff = send.data_ptr();
    c.recvbuff = recv.data_ptr();
    return c;
  }

  // A reducing call in place on `t`.
  static collCall_t reduce(collCallType_t type, const at::Tensor& t, const Reducing& r) {
    auto c = callOf(type);
    c.datatype = r.type;
    c.count = r.count;
    c.op = r.op;
    c.sendbuff = t.data_ptr();
    c.recvbuff = t.data_ptr();
    return c;
  }

  collCall_t reduceScatter(const at::Tensor& in, const at::Tensor& out, const c10d::ReduceOp& op, const char* call) {
    checkTensor(in, call);
    checkTensor(out, call);
    sameType(in, out, call);
    auto r = reducing(out, op, call);
    auto c = callOf(collCallReduceScatter);
    c.datatype = r.type;
    c.count = r.count;
    c.op = r.op;
    c.sendbuff = in.data_ptr();
    c.recvbuff = out.data_ptr();
    return c;
  }

  // all_gather into a list: straight into the outputs when they are one
  // block in rank order, else through a packed buffer; outputs of
  // different sizes gather by AllToAllv.
  Plan gatherInto(std::vector<at::Tensor>& outs, at::Tensor& in) {
    TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == size_, where("all_gather"), outs.size(), " outputs for ", size_, " ranks");
    bool even = true;
    for (auto& o : outs) {
      checkTensor(o, "all_gather");
      sameType(o, in, "all_gather");
      even = even && o.numel() == in.numel();
    }
    auto flatIn = in.reshape(-1);
    if (!even) {
      auto recv = at::empty({totalNumel(outs)}, in.options());
      Blocks v(size_);
      v.sendCounts.assign(size_, in.numel());
      v.packed(outs, v.recvCounts, v.recvDispls);
      return {{v.call(flatIn, recv, "all_gather")}, {flatIn, recv}, [recv, outs] { unpack(recv, outs); }};
    }
    if (adjacent(outs)) {
      auto whole = at::from_blob(outs[0].data_ptr(), {totalNumel(outs)}, in.options());
      return {{moving(collCallAllGather, flatIn, whole, "all_gather")}, {flatIn, outs[0]}, {}};
    }
    auto packed = at::empty({totalNumel(outs)}, in.options());
    return {{moving(collCallAllGather, flatIn, packed, "all_gather")}, {flatIn, packed}, [packed, outs] {
              unpack(packed, outs);
            }};
  }

  // Whether the tensors lie one after another in memory, in order.
  static bool adjacent(const std::vector<at::Tensor>& ts) {
    auto* next = static_cast<char*>(ts[0].data_ptr());
    for (auto& t : ts) {
      if (t.data_ptr() != next) {
        return false;
      }
      next += t.numel() * t.element_size();
    }
    return true;
  }

  static int64_t totalNumel(const std::vector<at::Tensor>& ts) {
    int64_t n = 0;
    for (auto& t : ts) {
      n += t.numel();
    }
    return n;
  }

  static std::vector<at::Tensor> flatAll(const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> flat;
    for (auto& t : ts) {
      flat.push_back(t.reshape(-1));
    }
    return flat;
  }

  static std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
    std::vector<at::Tensor> all;
    for (auto& l : lists) {
      all.insert(all.end(), l.begin(), l.end());
    }
    return all;
  }

  static std::vector<at::Tensor> concat(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    std::vector<at::Tensor> all(a);
    all.insert(all.end(), b.begin(), b.end());
    return all;
  }

  // Copies the blocks of `packed` into `outs`, in order.
  static void unpack(const at::Tensor& packed, const std::vector<at::Tensor>& outs) {
    int64_t at = 0;
    for (auto o : outs) {
      o.copy_(packed.narrow(0, at, o.numel()).view(o.sizes()));
      at += o.numel();
    }
  }

  // Starts the plan's calls in order and returns their Work, which keeps
  // the plan's tensors alive until they ended, gives `outputs` as its
  // result and runs the plan's `then` once they succeeded. A call torch will wait for at once (asyncOp
  // false: dist.all_reduce(t) without async_op) runs here, on this thread,
  // without handing it to the library's progress thread and back.
  c10::intrusive_ptr<WorkCollectives> start(
      OpType type,
      const char* title,
      const std::vector<at::Tensor>& inputs,
      Plan plan,
      std::vector<at::Tensor> outputs,
      How how = {}) {
    auto w = c10::make_intrusive<WorkCollectives>(
        rank_, type, title, inputs, std::move(plan.keep), std::move(outputs), std::move(plan.then));
    const bool here = !how.async && how.timeout.count() <= 0;
    if (how.timeout.count() > 0) {
      auto self = c10::weak_intrusive_ptr<BackendCollectives>(
          c10::intrusive_ptr<BackendCollectives>::reclaim_copy(this));
      w->setTimeout(how.timeout, [self](const std::string& why) {
        if (auto b = self.lock()) {
          b->revoke(why);
        }
      });
    }
    std::shared_lock<std::shared_mutex> g(lock_);
    const collComm_t comm = live();
    const auto what = [type] { return c10d::opTypeToString(type); };
    for (const auto& c : plan.calls) {
      if (here) {
        check(collCall(comm, &c), comm, what().c_str());
        continue;
      }
      collRequest_t r = nullptr;
      check(collStart(comm, &c, &r), comm, what().c_str());
      w->add(r);
    }
    seq_ += 1;
    return w;
  }

  collComm_t comm_;
  // Calls hold it shared; shutdown, which frees the communicator, alone.
  mutable std::shared_mutex lock_;
  c10::intrusive_ptr<Options> options_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<bool> revoked_{false};
};

// The Python object's hold on a backend, which lets go of the GIL first:
// the last reference ends the communicator, which waits for its peers and
// its progress thread (torch holds its own backends the same way).
template <typename T>
class HeldWithoutGil {
 public:
  HeldWithoutGil() = default;
  HeldWithoutGil(c10::intrusive_ptr<T> p) : p_(std::move(p)) {}
  // pybind builds holders from new objects this way (pybind11 issue 2957).
  explicit HeldWithoutGil(T* p) : p_(c10::intrusive_ptr<T>::unsafe_steal_from_new(p)) {}
  HeldWithoutGil(const HeldWithoutGil&) = default;
  HeldWithoutGil(HeldWithoutGil&&) noexcept = default;
  HeldWithoutGil& operator=(const HeldWithoutGil&) = default;
  HeldWithoutGil& operator=(HeldWithoutGil&&) noexcept = default;
  ~HeldWithoutGil() {
    if (p_ && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      p_.reset();
    }
  }
  T* get() const {
    return p_.get();
  }

 private:
  c10::intrusive_ptr<T> p_;
};

} // namespace collectives_torch

PYBIND11_DECLARE_HOLDER_TYPE(T, collectives_torch::HeldWithoutGil<T>, true)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace collectives_torch;
  m.doc() = "The collectives backend of torch.distributed (a c10d::Backend over the C ABI)";
  py::class_<BackendCollectives, c10d::Backend, HeldWithoutGil<BackendCollectives>>(m, "BackendCollectives")
      .def(
          // The GIL goes only around the joining: pybind records the new
          // object in its tables after, and that needs the GIL.
          py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout) {
            py::gil_scoped_release nogil;
            return BackendCollectives::create(store, rank, size, timeout);
          }),
          py::arg("store"),
          py::arg("rank"),
          py::arg("size"),
          py::arg("timeout"))
      .def(
          "failed_ranks",
          &BackendCollectives::failedRanks,
          "The ranks of this group that failed, the same list on every survivor "
          "(each must call it): what to pass to dist.shrink_group.",
          py::call_guard<py::gil_scoped_release>());
  m.def("_stop_completer", [] { Completer::get().stop(); });
}
