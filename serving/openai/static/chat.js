// The xlaserve chat page: talks to this server's OpenAI API (GET /v1/models and streaming
// POST /v1/chat/completions). Model output only ever enters the page as text (textContent,
// Text nodes), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);

let history = []; // user and assistant turns; the system prompt is added per request
let controller = null; // AbortController of the request in flight, if any

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The message of an error response ({"error": {"message", ...}}), else its status line.
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body.error?.message) return body.error.message;
  } catch {
    // not JSON: fall through
  }
  return `${response.status} ${response.statusText}`;
}

async function loadModels() {
  $("model-status").textContent = "loading…";
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorMessage(response));
    const { data } = await response.json();
    $("model").replaceChildren(...data.map((m) => new Option(m.id, m.id)));
    $("model-status").textContent = "";
  } catch (e) {
    $("model").replaceChildren();
    $("model-status").textContent = `could not list models: ${e.message}`;
  }
}

// A number input's value, or undefined when blank (JSON.stringify then leaves the field out,
// so the server's default applies).
function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

function requestBody() {
  const system = $("system").value.trim();
  return {
    model: $("model").value || undefined,
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    max_tokens: numberField("max_tokens"),
    seed: numberField("seed"),
    response_format: $("json_mode").checked ? { type: "json_object" } : undefined,
  };
}

// Yields the parsed JSON of each `data:` line of a server-sent event stream, until [DONE].
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split(/\r?\n/);
      buffer = lines.pop(); // an incomplete line waits for the next chunk
      for (const line of lines) {
        if (!line.startsWith("data:")) continue; // blank separators, comments, other fields
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// Live speed readout. Tokens are counted as content deltas while streaming and corrected by
// the final usage chunk; the rate is decode speed, measured from the first token.
class Meter {
  constructor() {
    this.start = performance.now();
    this.first = null;
    this.last = null;
    this.tokens = 0;
    this.show();
  }

  delta() {
    this.last = performance.now();
    this.first ??= this.last;
    this.tokens += 1;
    this.show();
  }

  usage(completionTokens) {
    this.tokens = completionTokens;
    this.show();
  }

  show() {
    const seconds = (this.last - this.first) / 1000;
    const rate = this.tokens > 1 && seconds > 0 ? (this.tokens - 1) / seconds : 0;
    $("rate").value = rate.toFixed(1);
    $("tokens").value = String(this.tokens);
    $("ttft").value = this.first === null ? "–" : `${Math.round(this.first - this.start)} ms`;
  }
}

function addBubble(role, text) {
  const li = document.createElement("li");
  li.className = role;
  li.textContent = text;
  $("transcript").append(li);
  scrollDown();
  return li;
}

function addNote(li, text) {
  const note = document.createElement("span");
  note.className = "note";
  note.textContent = text;
  li.append(note);
}

function scrollDown() {
  const transcript = $("transcript");
  transcript.scrollTop = transcript.scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  const turns = history; // "New conversation" replaces history; a late reply must not land in it
  turns.push({ role: "user", content: text });
  const question = addBubble("user", text);
  const bubble = addBubble("assistant streaming", "");
  const reply = bubble.appendChild(document.createTextNode(""));
  const meter = new Meter();
  const abort = new AbortController();
  controller = abort;
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody()),
      signal: abort.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const event of sseEvents(response.body)) {
      abort.signal.throwIfAborted(); // Stop also drops events already received
      if (event.error) throw new Error(event.error.message ?? JSON.stringify(event.error));
      const content = event.choices?.[0]?.delta?.content;
      if (content) {
        reply.appendData(content);
        meter.delta();
        scrollDown();
      }
      if (event.usage) meter.usage(event.usage.completion_tokens);
    }
    turns.push({ role: "assistant", content: reply.data });
  } catch (e) {
    if (e.name === "AbortError") {
      turns.push({ role: "assistant", content: reply.data }); // keep what came before Stop
      addNote(bubble, "stopped");
    } else {
      turns.pop(); // the question was not answered: leave it out of the conversation
      addNote(question, "not answered");
      bubble.classList.add("error");
      addNote(bubble, `Error: ${e.message}`);
    }
  } finally {
    bubble.classList.remove("streaming");
    if (controller === abort) {
      controller = null;
      setBusy(false);
    }
  }
}

function onSubmit(event) {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || controller) return;
  $("message").value = "";
  send(text);
}

function onMessageKey(event) {
  // Enter sends, Shift+Enter adds a line; not while an input method is composing.
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
}

function clearConversation() {
  controller?.abort();
  history = [];
  $("transcript").replaceChildren();
  new Meter(); // resets the readout
}

$("composer").addEventListener("submit", onSubmit);
$("message").addEventListener("keydown", onMessageKey);
$("stop").addEventListener("click", () => controller?.abort());
$("clear").addEventListener("click", clearConversation);
$("api-key").addEventListener("change", loadModels);
loadModels();
