// The live dashboard: polls GET /dashboard/stats about once a second (only the chart points since the
// last poll come back), shows the figures, draws the block pool and the last five minutes of charts.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const SPAN_S = 300;
  const MAX_CELLS = 4096; // the block pool picture: one cell per block, or per group of blocks
  const state = { since: null, points: [], timer: null };

  const ms = (seconds) => (seconds === null || seconds === undefined ? "–" : String(Math.round(seconds * 1000)));
  const percent = (value) => (value === null || value === undefined ? "–" : (value * 100).toFixed(1) + " %");
  const fixed = (value, digits) => (value === null || value === undefined ? "–" : value.toFixed(digits));

  function showError(text) {
    $("error").textContent = text || "";
    $("error").hidden = !text;
  }

  function drawPool(pool, canvas) {
    const perCell = Math.max(1, Math.ceil(pool.num_blocks / MAX_CELLS));
    const cells = Math.ceil(pool.num_blocks / perCell);
    const columns = Math.min(cells, 128);
    const rows = Math.ceil(cells / columns);
    const size = 8;
    canvas.width = columns * size;
    canvas.height = rows * size;
    canvas.style.maxWidth = columns * size * 1.5 + "px";
    const ctx = canvas.getContext("2d");
    const styles = getComputedStyle(document.documentElement);
    const colors = ["--used", "--cached", "--free"].map((name) => styles.getPropertyValue(name).trim());
    const bounds = [pool.used, pool.used + pool.cached_free];
    for (let cell = 0; cell < cells; cell++) {
      const block = cell * perCell;
      const kind = block < bounds[0] ? 0 : block < bounds[1] ? 1 : 2;
      ctx.fillStyle = colors[kind];
      ctx.fillRect((cell % columns) * size, Math.floor(cell / columns) * size, size - 1, size - 1);
    }
  }

  function renderPools(pools) {
    const container = $("pools");
    if (pools.length === 0) {
      container.textContent = "No paged KV cache to show (the engine has none, or it is starting).";
      return;
    }
    const keep = [];
    pools.forEach((pool, i) => {
      const id = "pool-" + i;
      let block = document.getElementById(id);
      if (!block) {
        block = document.createElement("div");
        block.id = id;
        const caption = document.createElement("div");
        caption.className = "sub pool-caption";
        const canvas = document.createElement("canvas");
        canvas.setAttribute("role", "img");
        block.append(caption, canvas);
        container.appendChild(block);
      }
      const caption = block.querySelector(".pool-caption");
      caption.textContent =
        pool.model + " · replica " + pool.replica + ": " + pool.used + " in use, " + pool.cached_free +
        " cached, " + pool.free + " free of " + pool.num_blocks + " blocks";
      const canvas = block.querySelector("canvas");
      canvas.setAttribute("aria-label", caption.textContent);
      drawPool(pool, canvas);
      keep.push(block);
    });
    for (const child of [...container.children]) if (!keep.includes(child)) child.remove();
  }

  function renderReasons(finished) {
    const rows = Object.entries(finished).map(([reason, count]) => {
      const row = document.createElement("tr");
      const name = document.createElement("th");
      name.textContent = reason;
      const value = document.createElement("td");
      value.textContent = String(count);
      value.dataset.reason = reason;
      row.append(name, value);
      return row;
    });
    $("reasons").replaceChildren(...rows);
  }

  function renderCharts() {
    const points = state.points;
    const times = points.map((p) => p.t);
    const pick = (key, scale) => points.map((p) => (p[key] === null ? null : p[key] * (scale || 1)));
    drawChart($("chart-throughput"), times, [
      { label: "generation", color: "#2f6fde", values: pick("generation_tokens_per_s") },
      { label: "prompt", color: "#f0a020", values: pick("prompt_tokens_per_s") },
    ], { span_s: SPAN_S });
    drawChart($("chart-requests"), times, [
      { label: "running", color: "#2f6fde", values: pick("running") },
      { label: "waiting", color: "#c62828", values: pick("waiting") },
    ], { span_s: SPAN_S });
    drawChart($("chart-kv"), times, [{ label: "in use", color: "#2f6fde", values: pick("kv_usage", 100) }], {
      span_s: SPAN_S, max: 100, format: (v) => v + "%",
    });
    drawChart($("chart-latency"), times, [
      { label: "TTFT p50", color: "#2f6fde", values: pick("ttft_p50_s", 1000) },
      { label: "TTFT p99", color: "#7b9fe6", values: pick("ttft_p99_s", 1000) },
      { label: "ITL p50", color: "#f0a020", values: pick("itl_p50_s", 1000) },
      { label: "ITL p99", color: "#f5c56b", values: pick("itl_p99_s", 1000) },
    ], { span_s: SPAN_S });
  }

  function render(report) {
    const window_ = report.window;
    $("running").textContent = String(report.running);
    $("waiting").textContent = String(report.waiting);
    const pools = report.block_pools;
    const total = pools.reduce((sum, p) => sum + p.num_blocks, 0);
    const used = pools.reduce((sum, p) => sum + p.used, 0);
    const cached = pools.reduce((sum, p) => sum + p.cached_free, 0);
    $("kv-usage").textContent = total ? percent(used / total) : "–";
    $("kv-blocks").textContent = total ? used + " used, " + cached + " cached of " + total + " blocks" : "no paged cache";
    $("hit-rate").textContent = percent(report.prefix_cache_hit_rate);
    $("hit-rate-total").textContent = percent(report.prefix_cache_hit_rate_total) + " since start";
    $("generation-tps").textContent = fixed(window_.generation_tokens_per_s, 1);
    $("prompt-tps").textContent = fixed(window_.prompt_tokens_per_s, 1) + " prompt tokens/s";
    $("tokens-per-step").textContent = fixed(window_.tokens_per_step, 1);
    $("steps-per-s").textContent = fixed(window_.steps_per_s, 1) + " steps/s";
    const q = (d) => [d["0.5"], d["0.9"], d["0.99"]].map(ms).join(" / ");
    $("ttft").textContent = q(window_.ttft_s);
    $("ttft-count").textContent = window_.num_first_tokens + " first tokens, milliseconds";
    $("itl").textContent = q(window_.itl_s);
    $("preemptions").textContent = String(report.preemptions);
    $("preemptions-window").textContent = window_.preemptions + " in the last minute";
    renderPools(pools);
    renderReasons(report.finished);
    state.points.push(...report.points);
    const oldest = report.now - SPAN_S;
    while (state.points.length && state.points[0].t < oldest) state.points.shift();
    renderCharts();
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  }

  async function poll() {
    try {
      const url = state.since === null ? "/dashboard/stats" : "/dashboard/stats?since=" + state.since;
      const response = await fetch(url, { cache: "no-store" });
      if (!response.ok) throw new Error("HTTP " + response.status);
      const report = await response.json();
      state.since = report.now;
      render(report);
      showError("");
    } catch (err) {
      showError("Cannot reach the server: " + err.message);
    } finally {
      state.timer = setTimeout(poll, 1000);
    }
  }

  poll();
})();
