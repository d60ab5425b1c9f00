// The SQL console: runs the query with edgepg in this page over the chosen transport, shows the
// rows, and draws the run's network flights (recorded by record.js) as a waterfall.
import { Client, httpSql } from '/dist/index.mjs'
import { recorder } from './record.js'
import { flightsOf, renderRuns } from './waterfall.js'
import { live } from './live.js'

const { connection } = await (await fetch('/config.json')).json()
const { host, port, user, password, database } = connection
const connectionString = `postgres://${user}:${password}@${host}:${port}/${database}`
/** The demo server relays to edgepg-proxy, holding every chunk RTT/2 each way. */
const netUrl = (rtt, route) => `${route === 'v2' ? location.origin.replace(/^http/, 'ws') : location.origin}/net/${rtt}/${route}`

/** new Client → connect() → query(): the run ends at the result; end() is not part of it. */
async function viaClient(text, rtt, rec, extra) {
  const client = new Client({
    host, port, user, password, database,
    webSocketConstructor: rec.WebSocket,
    wsProxy: () => netUrl(rtt, 'v2'),
    connectionTimeoutMillis: 15_000,
    ...extra,
  })
  client.on('error', () => {}) // a failure rejects connect() or the query; no unhandled 'error' besides
  try {
    await client.connect()
    const res = await client.query({ text, rowMode: 'array' })
    rec.stop()
    const last = Array.isArray(res) ? res[res.length - 1] : res // several statements: the last result
    return { fields: last.fields.map((f) => f.name), rows: last.rows, command: last.command, rowCount: last.rowCount ?? last.rows.length }
  } finally {
    rec.stop()
    client.end().catch(() => {})
  }
}

async function viaHttp(text, rtt, rec) {
  const sql = httpSql(connectionString, { fetchEndpoint: netUrl(rtt, 'sql'), fetch: rec.fetch })
  const res = await sql.query(text, [], { arrayMode: true, fullResults: true })
  rec.stop()
  return { fields: res.fields.map((f) => f.name), rows: res.rows, command: res.command, rowCount: res.rowCount ?? res.rows.length }
}

const TRANSPORTS = {
  ws: { label: 'WebSocket Client, login in the upgrade', run: (text, rtt, rec) => viaClient(text, rtt, rec, {}) },
  'ws-e2e': { label: 'WebSocket Client, SCRAM end to end', run: (text, rtt, rec) => viaClient(text, rtt, rec, { authOffload: false }) },
  http: { label: 'HTTP sql', run: viaHttp },
}

const $ = (sel) => document.querySelector(sel)
const form = $('#console')
const status = $('#status')
const runs = []
const KEEP = 6
let nextId = 1

$('#connection').textContent = connectionString
live({ connection: { host, port, user, password, database }, wsProxy: () => netUrl(0, 'v2') })

async function run(transport) {
  const text = $('#sql').value
  const rtt = Number(form.elements.rtt.value)
  const id = nextId++
  Object.assign(status.dataset, { state: 'running', runId: id })
  status.textContent = `Running over ${TRANSPORTS[transport].label}…`
  const rec = recorder()
  let result, error
  try {
    result = await TRANSPORTS[transport].run(text, rtt, rec)
  } catch (err) {
    error = err
  }
  const duration = rec.stop()
  const entry = { id, transport, label: TRANSPORTS[transport].label, rtt, duration, events: [...rec.events], rowCount: result?.rowCount ?? 0, error }
  runs.unshift(entry)
  runs.length = Math.min(runs.length, KEEP)
  showResult(result, error)
  renderRuns($('#runs'), runs)
  const { roundTrips } = flightsOf(entry.events)
  const rt = $('#round-trips')
  const afterOpen = roundTrips - entry.events.filter((e) => e.dir === 'connect' && !e.failed).length
  Object.assign(rt.dataset, { count: roundTrips, afterOpen, runId: id })
  rt.textContent = `${roundTrips} round trip${roundTrips === 1 ? '' : 's'}${transport === 'http' ? '' : ` (WebSocket upgrade + ${afterOpen})`}, first result after ${Math.round(duration)} ms`
  status.textContent = error ? 'Failed.' : `${result.command ?? 'OK'} · ${result.rowCount} row${result.rowCount === 1 ? '' : 's'} · ${Math.round(duration)} ms`
  Object.assign(status.dataset, { state: error ? 'error' : 'done', runId: id })
  return entry
}

function showResult(result, error) {
  const box = $('#error')
  box.hidden = !error
  box.textContent = error ? describe(error) : ''
  const rows = $('#rows')
  if (!result) return rows.replaceChildren()
  const table = document.createElement('table')
  const head = table.createTHead().insertRow()
  for (const name of result.fields) head.append(Object.assign(document.createElement('th'), { textContent: name }))
  const body = table.createTBody()
  for (const row of result.rows) {
    const tr = body.insertRow()
    for (const value of row) {
      const td = tr.insertCell()
      td.textContent = format(value)
      if (value === null) td.className = 'null'
      else if (typeof value === 'number' || /^-?\d+(\.\d+)?$/.test(String(value))) td.className = 'num'
    }
  }
  rows.replaceChildren(result.fields.length ? table : Object.assign(document.createElement('p'), { className: 'note', textContent: `${result.command ?? 'OK'}: no columns` }))
}

/** Postgres errors with their SQLSTATE and position hints, as psql shows them. */
function describe(err) {
  const lines = [`${err.severity ?? 'Error'}${err.code ? ` ${err.code}` : ''}: ${err.message}`]
  if (err.detail) lines.push(`DETAIL: ${err.detail}`)
  if (err.hint) lines.push(`HINT: ${err.hint}`)
  return lines.join('\n')
}

const format = (v) =>
  v === null ? 'NULL'
  : v instanceof Date ? v.toISOString().replace('T', ' ').replace(/\.000Z$/, 'Z')
  : typeof v === 'object' ? JSON.stringify(v)
  : String(v)

let busy = false
async function exclusive(fn) {
  if (busy) return
  busy = true
  form.classList.add('busy')
  try {
    await fn()
  } finally {
    busy = false
    form.classList.remove('busy')
  }
}

form.addEventListener('submit', (e) => {
  e.preventDefault()
  exclusive(() => run(form.elements.transport.value))
})
$('#compare').addEventListener('click', () =>
  exclusive(async () => {
    const ids = []
    for (const transport of ['ws', 'ws-e2e', 'http']) ids.push((await run(transport)).id)
    compare(runs.filter((r) => ids.includes(r.id)).reverse())
  })
)

/** The three runs of "Compare all three", side by side: one table of round trips, milliseconds and outcome (rows, or why it failed), above the last run's rows. */
function compare(three) {
  const table = document.createElement('table')
  table.id = 'comparison'
  const head = table.createTHead().insertRow()
  for (const name of ['transport', 'round trips', 'first result', 'outcome']) head.append(Object.assign(document.createElement('th'), { textContent: name }))
  const body = table.createTBody()
  for (const r of three) {
    const tr = body.insertRow()
    tr.dataset.transport = r.transport
    tr.dataset.roundTrips = flightsOf(r.events).roundTrips
    tr.insertCell().textContent = r.label
    Object.assign(tr.insertCell(), { className: 'num', textContent: r.error ? 'failed' : tr.dataset.roundTrips })
    Object.assign(tr.insertCell(), { className: 'num', textContent: `${Math.round(r.duration)} ms` })
    Object.assign(tr.insertCell(), { className: r.error ? 'error' : '', textContent: r.error ? describe(r.error).split('\n')[0] : `${r.rowCount} row${r.rowCount === 1 ? '' : 's'}` })
  }
  const rt = $('#round-trips')
  rt.textContent = `the three runs below, compared above at ${three[0].rtt} ms RTT`
  delete rt.dataset.count
  $('#rows').prepend(table)
  status.textContent = `Compared at ${three[0].rtt} ms RTT: round trips and time to the first result, then the last run's rows.`
}
$('#clear').addEventListener('click', () => {
  runs.length = 0
  $('#runs').replaceChildren()
})
$('#sql').addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) form.requestSubmit()
})
// The first run is as fast as later ones: the driver's code in this page and the proxy's for this
// login are warmed first, over each transport (not recorded; the proxy then holds a backend for it).
status.textContent = 'Warming up the driver and the proxy…'
const idle = () => ({ WebSocket: globalThis.WebSocket, fetch: globalThis.fetch.bind(globalThis), stop: () => 0 })
for (const transport of ['ws', 'ws-e2e', 'http']) await TRANSPORTS[transport].run('SELECT 1', 0, idle()).catch(() => {})
status.textContent = 'Pick a transport and a delay, then run the query.'
form.dataset.ready = 'true'
