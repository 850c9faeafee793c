// The agentmesh dashboard: Preact + htm, live by server-sent events (/api/events).
import { h, render } from "preact";
import { useEffect, useMemo, useState } from "preact/hooks";
import htm from "htm";

const html = htm.bind(h);

const EXAMPLES = {
  group_chat: {
    agent_ids: ["IndustryExpertAgent", "TechnicalAnalysisAgent", "FundamentalAnalysisAgent"],
    query: "What stock should I buy?",
    option_label: "stocks",
  },
  handoff_workflow: {
    task: "Process refund for order #12345",
    steps: [
      { agent_id: "CustomerAgent" },
      { agent_id: "SellerAgent" },
      { agent_id: "PaymentAgent" },
      { agent_id: "NotificationAgent" },
    ],
    context: { order_id: "12345" },
    failure_agent: "NotificationAgent",
  },
  collaborative_filtering: {
    agent_ids: ["PriceAgent", "QualityAgent", "LocationAgent", "ReviewsAgent"],
    weights: { price: 0.2, quality: 0.4, location: 0.3, reviews: 0.1 },
    query: "Hotel in Paris near Eiffel Tower",
  },
  consensus: { problem: "Should we migrate to microservices?", wait_for_all_votes: true },
  research: { query: "What is the latest lithium-ion battery recycling rate?" },
  route: { request_type: "stock_recommendation", query: "What stock should I buy?" },
  parallel: {
    patterns: [
      { name: "stocks", route: { request_type: "stock_recommendation", query: "Best stock?" } },
      { name: "hotels", route: { request_type: "hotel_recommendation", query: "Hotel in Paris" } },
    ],
  },
};

async function getJSON(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
  return response.json();
}

// POSTs a JSON body (with the gateway credential, when one is given): {ok: true, ...answer}
// or {ok: false, message}, also when the dashboard could not be reached (said, not lost).
async function postJSON(url, body, token) {
  const headers = { "Content-Type": "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  let response, text;
  try {
    response = await fetch(url, { method: "POST", headers, body: JSON.stringify(body) });
    text = await response.text();
  } catch (err) {
    return { ok: false, message: `the dashboard could not be reached: ${err.message}` };
  }
  try {
    const answer = JSON.parse(text);
    return response.ok ? { ok: true, ...answer } : { ok: false, message: answer.message || text };
  } catch {
    return { ok: false, message: text };
  }
}

// The gateway credential an action is taken with, when security is on.
function Credential({ id, token, set }) {
  return html`<input
    id=${id}
    type="password"
    placeholder="gateway credential"
    value=${token}
    onInput=${(e) => set(e.target.value)}
  />`;
}

function fmt(value, digits = 2) {
  return typeof value === "number" ? value.toFixed(digits) : "–";
}

// -- charts -------------------------------------------------------------------------------

function Chart({ title, points, series, unit }) {
  const width = 460;
  const height = 140;
  const pad = 28;
  const values = points.flatMap((p) => series.map((s) => p[s.key] || 0));
  const top = Math.max(1e-9, ...values) * 1.1;
  const path = (key) =>
    points
      .map((p, i) => {
        const x = pad + (i / Math.max(1, points.length - 1)) * (width - pad - 6);
        const y = height - pad / 2 - ((p[key] || 0) / top) * (height - pad);
        return `${i ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
      })
      .join(" ");
  const last = points[points.length - 1] || {};
  return html`<figure class="chart" data-chart=${title}>
    <figcaption>
      ${title}
      ${series.map(
        (s) => html`<span class="legend" style=${`color:${s.color}`}
          >${s.label} ${fmt(last[s.key])} ${unit}</span
        >`,
      )}
    </figcaption>
    <svg viewBox=${`0 0 ${width} ${height}`} role="img" aria-label=${title}>
      <text x="2" y="12" class="axis">${fmt(top, 1)}</text>
      <text x="2" y=${height - 4} class="axis">0</text>
      ${series.map(
        (s) => html`<path d=${path(s.key)} fill="none" stroke=${s.color} stroke-width="1.8" />`,
      )}
    </svg>
  </figure>`;
}

// -- panels -------------------------------------------------------------------------------

function Agents({ agents }) {
  return html`<section>
    <h2>Agents <small>${agents.length}</small></h2>
    <table id="agents">
      <thead>
        <tr>
          <th>agent</th><th>types</th><th>health</th><th>HIGH</th><th>MEDIUM</th><th>LOW</th>
          <th>in flight</th><th>deferred</th><th>dead</th><th>address</th>
        </tr>
      </thead>
      <tbody>
        ${agents.map(
          (a) => html`<tr data-agent=${a.agent_id}>
            <td class="id">${a.agent_id}</td>
            <td>${a.agent_types.join(", ")}</td>
            <td class=${`health ${a.health}`}>${a.health}</td>
            <td>${a.high}</td><td>${a.medium}</td><td>${a.low}</td>
            <td>${a.in_flight}</td><td>${a.deferred}</td><td>${a.dead_letters}</td>
            <td class="addr">${a.address}${pushLabel(a)}</td>
          </tr>`,
        )}
      </tbody>
    </table>
  </section>`;
}

// " (push)" when the broker calls every instance's server, " (push: 1 of 2)" when some pull.
function pushLabel(a) {
  if (!a.push_instances) return "";
  if (a.push_instances === a.instances) return " (push)";
  return ` (push: ${a.push_instances} of ${a.instances})`;
}

// The hand-off workflows, as their status in the shared state says (workflow/<id>): the one
// handed off last first.
function Workflows({ workflows }) {
  const rows = [...workflows].reverse();
  return html`<section>
    <h2>Hand-off workflows <small>${workflows.length}</small></h2>
    ${rows.length
      ? html`<table id="workflows">
          <thead>
            <tr>
              <th>workflow</th><th>status</th><th>step</th><th>with</th><th>from</th>
              <th>task</th><th>handed off</th>
            </tr>
          </thead>
          <tbody>
            ${rows.map(
              (w) => html`<tr data-workflow=${w.workflow_id}>
                <td><code>${w.workflow_id}</code></td>
                <td>
                  <span class=${`status ${w.status}`} title=${w.error_reason}>${w.status}</span>
                </td>
                <td>${w.step}</td>
                <td class="id">${w.current_agent}</td>
                <td>${w.from_agent}</td>
                <td>${w.task_description}</td>
                <td>${w.handed_off_at && new Date(w.handed_off_at).toLocaleTimeString()}</td>
              </tr>`,
            )}
          </tbody>
        </table>`
      : html`<p class="note" id="workflows">none</p>`}
  </section>`;
}

function Waterfall({ trace }) {
  if (!trace) return null;
  if (!trace.spans.length) return html`<p class="note">${trace.note || "no spans"}</p>`;
  const critical = new Set(trace.critical_path);
  const total = Math.max(trace.total_ms, 1e-6);
  return html`<div class="waterfall" id="waterfall">
    <p>${trace.spans.length} spans, ${fmt(trace.total_ms)} ms; critical path highlighted</p>
    ${trace.spans.map(
      (s) => html`<div class=${`span ${critical.has(s.span_id) ? "critical" : ""}`}
        data-span=${s.span_id}>
        <span class="label" title=${s.service}>${s.name}</span>
        <span class="track">
          <span
            class="bar"
            style=${`left:${(s.offset_ms / total) * 100}%;width:${Math.max(
              0.4,
              (s.duration_ms / total) * 100,
            )}%`}
          ></span>
        </span>
        <span class="ms">${fmt(s.duration_ms)} ms</span>
      </div>`,
    )}
  </div>`;
}

function accuracyLine(pattern, stats) {
  const share = fmt(stats.accuracy * 100, 0);
  return `${pattern} accuracy ${share}% (${stats.satisfied} of ${stats.rated} rated runs)`;
}

function Feedback({ run, state }) {
  const [token, setToken] = useState("");
  const [answer, setAnswer] = useState(null);
  useEffect(() => setAnswer(null), [run.run_id]);
  if (!state.allow_runs || !["COMPLETED", "PARTIAL"].includes(run.status)) return null;
  const rate = async (satisfied) =>
    setAnswer(await postJSON(`/api/runs/${run.run_id}/feedback`, { satisfied }, token));
  return html`<p id="feedback">
    Did this outcome satisfy you?
    ${state.credential_required &&
    html`<${Credential} id="feedback-token" token=${token} set=${setToken} />`}
    <button id="satisfied" onClick=${() => rate(true)}>Yes</button>
    <button id="not-satisfied" onClick=${() => rate(false)}>No</button>
    ${answer &&
    (answer.ok
      ? html`<span id="accuracy">${accuracyLine(run.pattern, answer)}</span>`
      : html`<span class="error" id="feedback-error">${answer.message}</span>`)}
  </p>`;
}

function RunDetail({ run, events, state }) {
  const [trace, setTrace] = useState(null);
  useEffect(() => setTrace(null), [run.run_id]);
  return html`<section id="run-detail" data-run=${run.run_id}>
    <h2>
      ${run.pattern} <code>${run.run_id}</code>
      <span class=${`status ${run.status}`}>${run.status}</span>
      <button
        id="show-trace"
        onClick=${async () => setTrace(await getJSON(`/api/traces/${run.run_id}`))}
      >
        Trace waterfall
      </button>
    </h2>
    <ol class="events">
      ${events.map(
        (e) => html`<li class=${`event ${e.kind}`} data-kind=${e.kind}>
          <span class="kind">${e.kind}</span>
          ${e.agent_id && html`<span class="agent">${e.agent_id}</span>`}
          <span class="summary">${e.summary}</span>
          <span class="ms">${fmt(e.elapsed_ms, 1)} ms</span>
        </li>`,
      )}
    </ol>
    <${Feedback} run=${run} state=${state} />
    <${Waterfall} trace=${trace} />
  </section>`;
}

function StartPattern({ state, onStarted }) {
  const [pattern, setPattern] = useState("group_chat");
  const [body, setBody] = useState(JSON.stringify(EXAMPLES.group_chat, null, 2));
  const [token, setToken] = useState("");
  const [error, setError] = useState("");
  if (!state.allow_runs) return html`<section><p class="note">Read-only dashboard.</p></section>`;
  const choose = (name) => {
    setPattern(name);
    setBody(JSON.stringify(EXAMPLES[name] || {}, null, 2));
  };
  const start = async (event) => {
    event.preventDefault();
    setError("");
    let parsed;
    try {
      parsed = JSON.parse(body);
    } catch (e) {
      setError(`not JSON: ${e.message}`);
      return;
    }
    const answer = await postJSON(`/api/patterns/${pattern}`, parsed, token);
    if (!answer.ok) {
      setError(answer.message);
      return;
    }
    onStarted(answer.run_id);
  };
  return html`<section>
    <h2>Start a pattern</h2>
    <form id="start" onSubmit=${start}>
      <select id="pattern" value=${pattern} onChange=${(e) => choose(e.target.value)}>
        ${state.patterns.map((p) => html`<option value=${p}>${p}</option>`)}
      </select>
      ${state.credential_required &&
      html`<${Credential} id="token" token=${token} set=${setToken} />`}
      <textarea id="body" rows="8" value=${body} onInput=${(e) => setBody(e.target.value)} />
      <button id="run" type="submit">Start</button>
      ${error && html`<p class="error" id="start-error">${error}</p>`}
    </form>
  </section>`;
}

function DeadLetters({ state }) {
  const [letters, setLetters] = useState(null);
  const [token, setToken] = useState("");
  const [answer, setAnswer] = useState(null);
  const load = async () => setLetters(await getJSON("/api/dead-letters"));
  useEffect(() => {
    load();
  }, []);
  // Once what failed it is fixed: back in its agent's queue for a new round of attempts.
  const requeue = async (letter) => {
    const body = { agent_id: letter.to_agent, message_ids: [letter.message_id] };
    setAnswer(await postJSON("/api/dead-letters/requeue", body, token));
    await load();
  };
  const actions = state.allow_runs;
  return html`<section>
    <h2>Dead letters <button onClick=${load}>Refresh</button></h2>
    ${actions &&
    state.credential_required &&
    html`<${Credential} id="requeue-token" token=${token} set=${setToken} />`}
    ${answer &&
    (answer.ok
      ? html`<p id="requeue-result">
          ${answer.requeued} requeued${answer.left ? `, ${answer.left} left (queue full)` : ""}
        </p>`
      : html`<p class="error" id="requeue-result">${answer.message}</p>`)}
    ${letters &&
    (letters.length
      ? html`<table id="dead-letters">
          <thead>
            <tr>
              <th>message</th><th>from</th><th>to</th><th>reason</th><th>at</th>
              ${actions && html`<th></th>`}
            </tr>
          </thead>
          <tbody>
            ${letters.map(
              (d) => html`<tr>
                <td><code>${d.message_id}</code></td><td>${d.from_agent}</td>
                <td>${d.to_agent}</td><td>${d.reason}</td><td>${d.dead_lettered_at}</td>
                ${actions &&
                html`<td>
                  <button class="requeue" data-message=${d.message_id} onClick=${() => requeue(d)}>
                    Requeue
                  </button>
                </td>`}
              </tr>`,
            )}
          </tbody>
        </table>`
      : html`<p class="note" id="dead-letters">none</p>`)}
  </section>`;
}

// -- the page -----------------------------------------------------------------------------

function App() {
  const [state, setState] = useState(null);
  const [history, setHistory] = useState([]);
  const [runs, setRuns] = useState([]);
  const [selected, setSelected] = useState(null);
  const [events, setEvents] = useState({});
  const [workflows, setWorkflows] = useState([]);
  const [live, setLive] = useState(false);

  useEffect(() => {
    const source = new EventSource("/api/events");
    source.addEventListener("open", () => setLive(true));
    source.addEventListener("error", () => setLive(false));
    source.addEventListener("state", (e) => {
      const data = JSON.parse(e.data);
      setState(data);
      setHistory(data.history);
      setRuns(data.runs);
      setWorkflows(data.workflows || []);
    });
    source.addEventListener("workflows", (e) => setWorkflows(JSON.parse(e.data)));
    source.addEventListener("workflow", (e) => {
      const { key, row } = JSON.parse(e.data);
      setWorkflows((list) => {
        const others = list.filter((w) => w.key !== key);
        return row ? [...others, row].slice(-100) : others;
      });
    });
    source.addEventListener("snapshot", (e) => {
      const data = JSON.parse(e.data);
      setState((s) => ({ ...s, ...data }));
      setHistory((h) => [...h.slice(-299), data.point]);
    });
    source.addEventListener("event", (e) => {
      const { run, event } = JSON.parse(e.data);
      setRuns((list) => [run, ...list.filter((r) => r.run_id !== run.run_id)].slice(0, 50));
      setEvents((all) => ({ ...all, [run.run_id]: [...(all[run.run_id] || []), event] }));
    });
    return () => source.close();
  }, []);

  const select = async (runId) => {
    setSelected(runId);
    try {
      const detail = await getJSON(`/api/runs/${runId}`);
      // Both are the run's events in order; live ones may have arrived meanwhile.
      setEvents((all) => {
        const live = all[runId] || [];
        return { ...all, [runId]: detail.events.length >= live.length ? detail.events : live };
      });
    } catch {
      // not recorded yet: live events fill it in
    }
  };

  const current = useMemo(() => runs.find((r) => r.run_id === selected), [runs, selected]);
  if (!state) return html`<p class="note">connecting…</p>`;
  const t = state.totals || {};
  return html`<main>
    <header>
      <h1>agentmesh</h1>
      <span id="live" class=${live ? "live" : "offline"}>${live ? "live" : "offline"}</span>
      <span>held <b>${t.held}</b></span>
      <span>sent <b>${t.sent_count}</b></span>
      <span>delivered <b>${t.delivered_count}</b></span>
      <span>expired <b>${t.expired_count}</b></span>
      <span>dead <b>${t.dead_lettered_count}</b></span>
      <span title="requests whose requester gave up">withdrawn <b>${t.withdrawn_count}</b></span>
    </header>
    <div class="charts">
      <${Chart}
        title="Messages per second"
        points=${history}
        unit="/s"
        series=${[
          { key: "sent_per_s", label: "sent", color: "#2563eb" },
          { key: "delivered_per_s", label: "delivered", color: "#16a34a" },
        ]}
      />
      <${Chart}
        title="Send latency"
        points=${history}
        unit="ms"
        series=${[
          { key: "send_p50_ms", label: "p50", color: "#2563eb" },
          { key: "send_p95_ms", label: "p95", color: "#d97706" },
          { key: "send_p99_ms", label: "p99", color: "#dc2626" },
        ]}
      />
      <${Chart}
        title="Request/response latency"
        points=${history}
        unit="ms"
        series=${[
          { key: "roundtrip_p50_ms", label: "p50", color: "#2563eb" },
          { key: "roundtrip_p95_ms", label: "p95", color: "#d97706" },
          { key: "roundtrip_p99_ms", label: "p99", color: "#dc2626" },
        ]}
      />
    </div>
    <${Agents} agents=${state.agents || []} />
    <${Workflows} workflows=${workflows} />
    <div class="columns">
      <section>
        <h2>Pattern runs</h2>
        <ul id="runs">
          ${runs.map(
            (r) => html`<li
              class=${`run ${r.run_id === selected ? "selected" : ""}`}
              data-run=${r.run_id}
              onClick=${() => select(r.run_id)}
            >
              <span class="pattern">${r.pattern}</span> <code>${r.run_id}</code>
              <span class=${`status ${r.status}`}>${r.status}</span>
            </li>`,
          )}
        </ul>
      </section>
      <${StartPattern} state=${state} onStarted=${select} />
    </div>
    ${current &&
    html`<${RunDetail} run=${current} events=${events[current.run_id] || []} state=${state} />`}
    <${DeadLetters} state=${state} />
  </main>`;
}

render(html`<${App} />`, document.getElementById("app"));
