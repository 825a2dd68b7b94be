// The playground: chats with a served model over POST /v1/chat/completions (stream: true), reads the
// server-sent events as they arrive, and renders the answer as safe Markdown. Stop aborts the fetch; the
// server sees the disconnect and frees the request's KV blocks.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "pagedserve.apiKey";
  const state = { history: [], controller: null, config: { api_key_required: false } };

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function requestHeaders() {
    const headers = { "Content-Type": "application/json" };
    const key = $("api-key").value.trim();
    if (key) headers.Authorization = "Bearer " + key;
    return headers;
  }

  async function errorMessage(response) {
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      if (body && body.error) return typeof body.error === "string" ? body.error : body.error.message;
      return text;
    } catch (err) {
      return text || response.statusText;
    }
  }

  function explain(error) {
    if (error instanceof HttpError && error.status === 401) {
      return state.config.api_key_required
        ? "This server needs an API key: enter it in the API key field. (401: " + error.message + ")"
        : "Unauthorized (401): " + error.message;
    }
    if (error instanceof HttpError) return "Error " + error.status + ": " + error.message;
    return "Error: " + (error && error.message ? error.message : String(error));
  }

  function showError(text) {
    $("error").textContent = text || "";
    $("error").hidden = !text;
  }

  async function loadConfig() {
    try {
      const response = await fetch("/ui/config");
      if (response.ok) state.config = await response.json();
    } catch (err) {
      showError(explain(err));
    }
    $("api-key-row").hidden = !state.config.api_key_required;
    $("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
    if (state.config.version) $("server-version").textContent = "v" + state.config.version;
  }

  async function loadModels() {
    const select = $("model");
    const previous = select.value;
    if (state.config.api_key_required && !$("api-key").value.trim()) {
      showError("This server needs an API key: enter it in the API key field.");
      return;
    }
    try {
      const response = await fetch("/v1/models", { headers: requestHeaders() });
      if (!response.ok) throw new HttpError(response.status, await errorMessage(response));
      const body = await response.json();
      const ids = body.data.map((card) => card.id);
      select.replaceChildren(...ids.map((id) => new Option(id, id)));
      const wanted = ids.includes(previous) ? previous : state.config.default_model;
      if (ids.includes(wanted)) select.value = wanted;
      showError("");
    } catch (err) {
      showError(explain(err));
    }
  }

  function addMessage(role, text) {
    const node = document.createElement("div");
    node.className = "message " + role;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const content = document.createElement("div");
    content.className = "content";
    if (role === "user") content.textContent = text;
    else window.renderMarkdown(text, content);
    const figures = document.createElement("div");
    figures.className = "figures";
    node.append(label, content, figures);
    $("messages").appendChild(node);
    node.scrollIntoView({ block: "end" });
    return node;
  }

  function numberOrNull(id) {
    const raw = $(id).value.trim();
    if (raw === "") return null;
    const value = Number(raw);
    return Number.isFinite(value) ? value : null;
  }

  function buildRequest() {
    const messages = [];
    const system = $("system-prompt").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history);
    const body = {
      model: $("model").value,
      messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const temperature = numberOrNull("temperature");
    const topP = numberOrNull("top-p");
    const maxTokens = numberOrNull("max-tokens");
    const seed = numberOrNull("seed");
    if (temperature !== null) body.temperature = temperature;
    if (topP !== null) body.top_p = topP;
    if (maxTokens !== null) body.max_tokens = Math.trunc(maxTokens);
    if (seed !== null) body.seed = Math.trunc(seed);
    const stop = $("stop-sequences").value.split("\n").filter((s) => s.length > 0);
    if (stop.length > 0) body.stop = stop.slice(0, 4);
    return body;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("model").disabled = busy;
  }

  function formatFigures(run) {
    const parts = [];
    if (run.model) parts.push(run.model);
    if (run.firstAt !== null) parts.push("TTFT " + Math.round(run.firstAt - run.startedAt) + " ms");
    const tokens = run.completionTokens !== null ? run.completionTokens : run.pieces;
    if (run.firstAt !== null && tokens > 1 && run.endedAt > run.firstAt) {
      parts.push(((tokens - 1) / ((run.endedAt - run.firstAt) / 1000)).toFixed(1) + " tokens/s");
    }
    parts.push(tokens + " tokens");
    if (run.finishReason) parts.push("finish: " + run.finishReason);
    if (run.stopped) parts.push("stopped");
    return parts.join(" · ");
  }

  async function readEvents(response, signal, onEvent) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    // Cancel the reader itself on abort: a pending read then ends at once instead of waiting for the
    // aborted body's error to travel through the decoder.
    signal.addEventListener("abort", () => reader.cancel().catch(() => {}), { once: true });
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (signal.aborted) throw new DOMException("stopped", "AbortError");
      if (done) break;
      buffer += value.replace(/\r\n/g, "\n");
      for (let end = buffer.indexOf("\n\n"); end >= 0; end = buffer.indexOf("\n\n")) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data === "" || data === "[DONE]") continue;
        onEvent(JSON.parse(data));
      }
    }
  }

  async function send() {
    const text = $("message").value;
    if (!text.trim() || state.controller !== null) return;
    if (!$("model").value) {
      showError("No model to talk to yet: the model list could not be loaded.");
      return;
    }
    showError("");
    $("message").value = "";
    state.history.push({ role: "user", content: text });
    addMessage("user", text);
    const node = addMessage("assistant", "");
    const content = node.querySelector(".content");
    const figures = node.querySelector(".figures");
    const run = {
      model: null, startedAt: performance.now(), firstAt: null, endedAt: null,
      pieces: 0, completionTokens: null, finishReason: null, stopped: false,
    };
    let answer = "";
    let frame = 0;
    const paint = () => {
      frame = 0;
      window.renderMarkdown(answer, content);
      figures.textContent = formatFigures({ ...run, endedAt: performance.now() });
      node.scrollIntoView({ block: "end" });
    };
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: requestHeaders(),
        body: JSON.stringify(buildRequest()),
        signal: controller.signal,
      });
      if (!response.ok) throw new HttpError(response.status, await errorMessage(response));
      await readEvents(response, controller.signal, (chunk) => {
        if (chunk.error) throw new HttpError(chunk.error.code || 500, chunk.error.message || "stream error");
        if (chunk.model) run.model = chunk.model;
        if (chunk.usage) run.completionTokens = chunk.usage.completion_tokens;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          if (run.firstAt === null) run.firstAt = performance.now();
          run.pieces += 1;
          answer += piece;
          if (!frame) frame = requestAnimationFrame(paint);
        }
        if (choice.finish_reason) run.finishReason = choice.finish_reason;
      });
    } catch (err) {
      if (err.name === "AbortError") run.stopped = true;
      else showError(explain(err));
    } finally {
      if (frame) cancelAnimationFrame(frame);
      controller.abort(); // after an error mid-stream: drop the connection, so the server ends the request
      run.endedAt = performance.now();
      window.renderMarkdown(answer, content);
      figures.textContent = formatFigures(run);
      if (answer) state.history.push({ role: "assistant", content: answer });
      else state.history.pop(); // nothing came back: the question can be asked again
      state.controller = null;
      setBusy(false);
      $("message").focus();
    }
  }

  function wire() {
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      send();
    });
    $("message").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        send();
      }
    });
    $("stop").addEventListener("click", () => {
      if (state.controller !== null) state.controller.abort();
    });
    $("new-chat").addEventListener("click", () => {
      if (state.controller !== null) state.controller.abort();
      state.history = [];
      $("messages").replaceChildren();
      showError("");
    });
    $("api-key").addEventListener("change", () => {
      sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
      loadModels();
    });
  }

  wire();
  loadConfig().then(loadModels);
})();
