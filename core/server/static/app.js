// The mlxchat chat page: a client of the conversation API (see mlxchat/server/conversations.py).
// It renders the ChatState the server streams and posts the user's actions; it keeps no state of its own
// beyond the API key (localStorage) and the open conversation (the URL's #fragment).
"use strict";

// The page's own elements by id, taken once before anything is rendered: rendered content can carry ids (a reply
// holding <textarea id="message" hidden> took the composer's place for getElementById, and Enter sent its text).
const elements = new Map();
const $ = (id) => elements.get(id);
const page = {
  id: null, state: null, info: null, watching: null, images: [], localError: null,
  rendered: new Map(), // message id -> [signature, element]
};

// -- the API ---------------------------------------------------------------------------------------------

function headers(json) {
  const h = {};
  const key = localStorage.getItem("mlxchat-api-key");
  if (key) h.Authorization = "Bearer " + key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function api(method, path, body) {
  const response = await fetch(path, {method, headers: headers(body !== undefined),
                                      body: body === undefined ? undefined : JSON.stringify(body)});
  if (response.status === 401) { askKey(); throw new Error("this server needs an API key"); }
  const data = await response.json();
  if (!response.ok) throw new Error((data.error && data.error.message) || response.statusText);
  return data;
}

async function act(action, body) {
  try {
    page.localError = null;
    await api("POST", `/api/conversations/${page.id}/${action}`, body || {});  // the new state comes as an event
    render();
    return true;
  } catch (error) {
    page.localError = error.message;
    render();
    return false;
  }
}

function askKey() {
  $("key-form").hidden = false;
  $("key").focus();
}

// -- conversations ---------------------------------------------------------------------------------------

async function start() {
  let listing;
  try { listing = await api("GET", "/api/conversations"); } catch (error) { return; }
  page.info = listing;
  $("model").textContent = listing.model;
  $("attach-label").hidden = !listing.supports_images;
  fillList(listing.data);
  const wanted = location.hash.slice(1);
  if (wanted && listing.data.some((c) => c.id === wanted)) open(wanted);
  else if (listing.data.length) open(listing.data[0].id);
  else newConversation();
}

function fillList(conversations) {
  const select = $("conversations");
  select.replaceChildren(...conversations.map((c) => {
    const option = document.createElement("option");
    option.value = c.id;
    option.textContent = c.title;
    return option;
  }));
  if (page.id) select.value = page.id;
}

async function refreshList() {
  try { fillList((await api("GET", "/api/conversations")).data); } catch (error) { /* shown elsewhere */ }
}

async function newConversation() {
  try {
    const state = await api("POST", "/api/conversations", {});
    await refreshList();
    open(state.id);
  } catch (error) { page.localError = error.message; render(); }
}

function open(id) {
  if (page.watching) page.watching.abort();
  page.id = id;
  page.state = null;
  page.rendered.clear();
  $("messages").replaceChildren();
  history.replaceState(null, "", "#" + id);
  $("conversations").value = id;
  watch(id);
  $("message").focus();
}

async function watch(id) {
  const abort = page.watching = new AbortController();
  while (!abort.signal.aborted) {
    try {
      const response = await fetch(`/api/conversations/${id}/events`, {headers: headers(false), signal: abort.signal});
      if (response.status === 401) { askKey(); return; }
      if (!response.ok) throw new Error((await response.json()).error.message);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          event(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
        }
      }
    } catch (error) {
      if (abort.signal.aborted) return;
      page.localError = "lost the connection to the server; retrying";
      render();
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

function event(block) {
  let kind = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event: ")) kind = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (!data) return;
  const state = JSON.parse(data);
  if (state.id !== page.id) return;
  if (kind === "progress") {
    if (!page.state) return;
    state.messages = page.state.messages;
  }
  if (page.localError && page.localError.startsWith("lost the connection")) page.localError = null;
  const titled = page.state && page.state.messages.length === 0 && state.messages.length > 0;
  show(state);
  if (titled) refreshList();
}

function show(state) {
  page.state = state;
  render();
}

// -- rendering -------------------------------------------------------------------------------------------

// What rendered Markdown may hold besides DOMPurify's defaults' limits: no ids or names of the page's own
// (prefixed user-content-), no controls or dialogs, no classes or data attributes that would style it as the
// page's own parts (a user bubble, an approval box), nothing that opens above the page (popovers).
const SANITIZE = {
  SANITIZE_NAMED_PROPS: true,
  ALLOW_DATA_ATTR: false,
  FORBID_TAGS: ["form", "input", "textarea", "button", "select", "option", "label", "dialog", "style"],
  FORBID_ATTR: ["class", "popover", "popovertarget", "popovertargetaction", "form", "autofocus"],
};

function markdown(text) {
  const html = marked.parse(text || "", {gfm: true, async: false});
  const container = document.createElement("div");
  container.className = "body";
  container.innerHTML = DOMPurify.sanitize(html, SANITIZE);
  return container;
}

function element(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes || {})) {
    if (name === "onclick") node.addEventListener("click", value);
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function button(name, label, onclick, extra) {
  // The accessible name is the page's contract; where the label is an icon, the name is its aria-label.
  return element("button", {type: "button", "aria-label": name, title: name, onclick, text: label, ...(extra || {})});
}

function reportLine(report) {
  if (!report) return null;
  const tps = report.decode_tps ? `${report.decode_tps.toFixed(1)} tok/s` : "";
  return element("p", {
    class: "report", "data-prompt-tokens": report.prompt_tokens, "data-cached-tokens": report.cached_prompt_tokens,
    "data-generated-tokens": report.generated_tokens, "data-finish-reason": report.finish_reason,
    text: `prompt ${report.prompt_tokens} · cached ${report.cached_prompt_tokens} · generated ` +
          `${report.generated_tokens}${tps ? " · " + tps : ""}${report.finish_reason === "cancelled" ? " · stopped" : ""}`,
  });
}

function userContent(content) {
  if (typeof content === "string") return [element("div", {class: "body text", text: content})];
  const parts = [];
  for (const part of content || []) {
    if (part.type === "image" && typeof part.image === "string" && part.image.startsWith("data:image/")) {
      const img = element("img", {class: "attached", alt: "attached image"});
      img.src = part.image;
      parts.push(img);
    } else if (part.type === "text") parts.push(element("div", {class: "body text", text: part.text}));
  }
  return parts;
}

function callView(call, pending) {
  let args = call.function.arguments;
  try { args = JSON.stringify(JSON.parse(args)); } catch (error) { /* shown as written */ }
  const view = element("div", {class: "call", "data-call-id": call.id},
                       element("code", {text: `${call.function.name}(${args})`}));
  if (!pending) return view;
  const edited = element("textarea", {"aria-label": "Arguments", rows: 2});
  edited.value = args;
  const reason = element("input", {"aria-label": "Reason", placeholder: "Reason (when denying)"});
  const approve = () => {
    let parsed;
    try { parsed = JSON.parse(edited.value); } catch (error) {
      page.localError = "the arguments are not valid JSON"; render(); return;
    }
    const body = {call_id: call.id, approved: true};
    if (edited.value.trim() !== args) body.arguments = parsed;
    act("approval", body);
  };
  const deny = () => act("approval", {call_id: call.id, approved: false, ...(reason.value.trim() ? {reason: reason.value} : {})});
  view.append(element("p", {class: "muted", text: "This call needs your approval. Edit the arguments, or give a reason to deny it."}),
              edited, reason,
              element("div", {class: "controls"}, button("Approve", "Approve", approve), button("Deny", "Deny", deny)));
  return view;
}

function messageView(message, last, state) {
  const idle = state.status === "idle" || state.status === "error";
  const view = element("article", {class: "message", "data-role": message.role, "data-message-id": message.id || ""});
  view.append(element("div", {class: "who", text: message.role === "tool" ? `tool · ${message.name || ""}` : message.role}));
  if (message.role === "user") view.append(...userContent(message.content));
  else {
    if (message.reasoning_content) {
      view.append(element("details", {class: "reasoning"}, element("summary", {text: "Reasoning"}),
                          element("div", {class: "text", text: message.reasoning_content})));
    }
    if (message.content) view.append(markdown(message.content));
    const pending = new Set(state.pending_approvals.map((c) => c.id));
    for (const call of message.tool_calls || []) view.append(callView(call, pending.has(call.id)));
  }
  const versions = message.versions || [];
  const selected = message.selected_version || 0;
  if (versions.length) view.append(reportLine(versions[selected].report));
  const controls = element("div", {class: "controls"});
  if (versions.length > 1) {
    const select = (index) => act("select_version", {message_id: message.id, index});
    controls.append(button("Previous version", "<", () => select(selected - 1), selected === 0 || !idle ? {disabled: ""} : {}),
                    element("span", {class: "versions", text: `${selected + 1}/${versions.length}`}),
                    button("Next version", ">", () => select(selected + 1),
                           selected === versions.length - 1 || !idle ? {disabled: ""} : {}));
  }
  if (last && message.role === "assistant" && idle) controls.append(button("Regenerate", "Regenerate", () => act("regenerate")));
  if (idle && message.id) {
    controls.append(button("Restore checkpoint", "Restore checkpoint", () => act("restore_checkpoint", {message_id: message.id})));
  }
  if (controls.childElementCount) view.append(controls);
  return view;
}

function streamingView(message) {
  const view = element("article", {class: "message", "data-role": "assistant", "data-message-id": "streaming",
                                   "data-streaming": "true", "aria-busy": "true"});
  view.append(element("div", {class: "who", text: "assistant"}));
  if (message.reasoning_content) {
    view.append(element("details", {class: "reasoning"}, element("summary", {text: "Reasoning…"}),
                        element("div", {class: "text", text: message.reasoning_content})));
  }
  if (message.content) view.append(markdown(message.content));
  for (const call of message.tool_calls || []) view.append(callView(call, false));
  return view;
}

function render() {
  const state = page.state;
  const main = document.querySelector("main");
  const atBottom = main.scrollHeight - main.scrollTop - main.clientHeight < 48;
  const list = $("messages");
  const wanted = [];
  if (state) {
    const messages = state.messages.filter((m) => m.role !== "system");
    const pendingKey = state.pending_approvals.map((c) => c.id).join(",");
    messages.forEach((message, index) => {
      const last = index === messages.length - 1;
      const signature = JSON.stringify([message, last, state.status === "idle" || state.status === "error", pendingKey]);
      const key = message.id || `at-${index}`;
      const known = page.rendered.get(key);
      if (known && known[0] === signature) { wanted.push(known[1]); return; }
      const view = messageView(message, last, state);
      page.rendered.set(key, [signature, view]);
      wanted.push(view);
    });
    const keep = new Set(messages.map((m, i) => m.id || `at-${i}`));
    for (const key of [...page.rendered.keys()]) if (!keep.has(key)) page.rendered.delete(key);
    if (state.streaming_message) wanted.push(streamingView(state.streaming_message));
  }
  const current = [...list.children];
  if (current.length !== wanted.length || current.some((node, i) => node !== wanted[i])) list.replaceChildren(...wanted);

  renderQueue(state);
  renderInputs(state);
  const error = page.localError || (state && state.error);
  $("error").hidden = !error;
  $("error-text").textContent = error || "";
  const busy = state && (state.status === "streaming" || state.status === "awaiting_input");
  $("stop").disabled = !busy;
  $("status").textContent = !state ? "" : state.waiting ? "waiting for memory (other replies hold it)…" : {
    streaming: "writing…", awaiting_approval: "waiting for your approval", awaiting_input: "waiting for your answer",
    error: "stopped by an error", idle: "",
  }[state.status];
  if (atBottom) main.scrollTop = main.scrollHeight;
}

function renderQueue(state) {
  const queue = state ? state.queue : [];
  const signature = JSON.stringify(queue);
  if ($("queue").dataset.signature === signature) return;
  $("queue").dataset.signature = signature;
  $("queue").hidden = queue.length === 0;
  $("queue-list").replaceChildren(...queue.map((prompt) => element("li", {"data-queued-id": prompt.id},
    element("span", {text: prompt.text + (prompt.images.length ? ` (+${prompt.images.length} image)` : "")}),
    button("Send now", "Send now", () => act("send_queued_now", {id: prompt.id})),
    button("Remove from queue", "Remove from queue", () => act("remove_queued", {id: prompt.id})))));
}

function renderInputs(state) {
  const requests = state ? state.input_requests : [];
  const signature = requests.map((r) => r.id).join(",");
  if ($("inputs").dataset.signature === signature) return;
  $("inputs").dataset.signature = signature;
  $("inputs").replaceChildren(...requests.map((request) => {
    const answer = element("input", {"aria-label": "Answer", autocomplete: "off"});
    const send = () => act("input", {request_id: request.id, text: answer.value});
    answer.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); send(); } });
    return element("div", {class: "input-request", "data-request-id": request.id},
                   element("p", {text: `${request.name} asks: ${request.prompt}`}), answer,
                   element("div", {class: "controls"}, button("Send answer", "Send answer", send)));
  }));
}

// -- the composer ----------------------------------------------------------------------------------------

async function send() {
  const text = $("message").value;
  if (!text.trim() && !page.images.length) return;
  if (await act("send", {text, images: page.images})) {
    $("message").value = "";
    page.images = [];
    $("attachments").replaceChildren();
  }
}

function attach(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.onload = () => {
      page.images.push(reader.result);
      const preview = element("img", {alt: `attached ${file.name}`, title: "Click to remove"});
      preview.src = reader.result;
      preview.addEventListener("click", () => {
        page.images.splice(page.images.indexOf(reader.result), 1);
        preview.remove();
      });
      $("attachments").append(preview);
    };
    reader.readAsDataURL(file);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  for (const node of document.querySelectorAll("[id]")) elements.set(node.id, node);
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && page.state && !$("stop").disabled) { e.preventDefault(); act("stop"); }
  });
  $("stop").addEventListener("click", () => act("stop"));
  $("dismiss").addEventListener("click", () => {
    if (page.localError) { page.localError = null; render(); }
    if (page.state && page.state.error) act("dismiss_error");
  });
  $("new").addEventListener("click", newConversation);
  $("conversations").addEventListener("change", (e) => open(e.target.value));
  $("attach").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    localStorage.setItem("mlxchat-api-key", $("key").value);
    $("key-form").hidden = true;
    start();
  });
  start();
});
