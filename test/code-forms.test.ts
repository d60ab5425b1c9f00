/**
 * Code the database runs for a plain-looking statement leaves nothing for the next session (issue
 * 46). A generated corpus (test/support/code-forms.ts): every grammar node through which code of an
 * attacker's schema runs (calls, operators, comparisons by an opclass of theirs, casts, domain
 * CHECKs, defaults, triggers, rules, policies, views, the planner…) × what that code leaves
 * (search_path; a temp table, an advisory lock and a LISTEN) × how the statement is sent (simple,
 * extended, raw Parse naming the parameters' types, POST /sql).
 *
 * Through a transaction-mode proxy with one backend, session A runs the form and stays connected;
 * session B (same role, same proxy) then asks the backend it is lent, in Postgres's own catalogs,
 * what is there. The hooks log the backend they ran on, so we know B looked at A's backend. If B
 * gets 53300, A kept its backend: once A ends, B must find it clean. Over /sql, request 2 probes
 * after request 1 ran the form. A control run in session mode shows that each form, sent each way,
 * does leave its effect on its own session: a clean probe means a reset, not a form that did nothing.
 *
 * EDGEPG_CODE_FORMS_VERBOSE=1 prints every entry's outcome.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import type { Client, ClientConfig } from '../src/index'
import { startProxy, edgeClient, pgConfig, testPostgres, within } from './support/helpers'
import { PASSWORD } from './support/stack'
import { queryMessage } from './support/protocol'
import { offeredLogin, RawSession } from './support/raw-session'
import { buildEntries, differences, EFFECTS, FORMS, NOT_EXPRESSIBLE, PROBE_SQL, setupSql, shows, teardownSql, typedQuery, TYPES, type EffectKey, type Entry, type Probe, type TypeKey, type Way } from './support/code-forms'

const LANES = 8
/** Bound on one entry, whatever happens. */
const ENTRY_MS = 15_000
const SCHEMA = `edgepg_code_forms_${process.pid}`
const ROLES = Object.fromEntries(EFFECTS.map((e) => [e.key, `${SCHEMA}_${e.key}`])) as Record<EffectKey, string>

type Proxy = Awaited<ReturnType<typeof startProxy>>

// ── sessions ─────────────────────────────────────────────────────────────────────────────────

async function session(port: number, role: string, extra: ClientConfig = {}): Promise<Client> {
  const client = edgeClient(port, 'scram_user', { user: role, application_name: 'edgepg-code-forms', ...extra })
  client.on('error', () => {})
  await client.connect()
  return client
}

/** The subprotocols (the login among them) an edgepg Client of `role` offers the proxy. */
const clientLogin = (port: number, role: string) => offeredLogin((extra) => session(port, role, extra))

const codeOf = (err: any) => String(err?.code ?? err?.message ?? err)

/** Session A sends the entry's statement (`text`: the entry's own, or the control's); 'ok' or an error code. */
async function send(a: Client | RawSession, e: Entry, text = e.text): Promise<string> {
  if (a instanceof RawSession) return (await a.run(typedQuery(text, e.types, e.values, e.binary))).outcome
  const query = e.way === 'simple' ? text : { text, values: e.values, queryMode: 'extended' }
  return a.query(query as any).then(() => 'ok', codeOf)
}

/** The backend's state as `s` sees it, or 'busy' (53300: no backend free in time). */
async function probe(s: Client | RawSession): Promise<Probe | 'busy'> {
  if (s instanceof RawSession) {
    const { outcome, first } = await s.run(queryMessage(PROBE_SQL))
    if (outcome !== 'ok') return outcome === '53300' ? 'busy' : Promise.reject(new Error(`probe: ${outcome}`))
    return JSON.parse(first!)
  }
  return s.query(PROBE_SQL).then(
    (r) => JSON.parse(r.rows[0].probe),
    (err) => (err.code === '53300' ? 'busy' : Promise.reject(err))
  )
}

/** POST /sql as `role`: 'ok' or the error's code, and the rows. */
async function post(port: number, role: string, query: string, params: unknown[] = []): Promise<{ outcome: string; rows: any[] }> {
  const { host, port: pgPort, database } = testPostgres()
  const res = await fetch(`http://127.0.0.1:${port}/sql`, {
    method: 'POST',
    headers: { 'Neon-Connection-String': `postgresql://${role}:${encodeURIComponent(PASSWORD)}@${host}:${pgPort}/${database}` },
    body: JSON.stringify({ query, params }),
    signal: AbortSignal.timeout(10_000),
  })
  const json: any = await res.json().catch(() => ({}))
  return { outcome: res.ok ? 'ok' : String(json.code ?? `HTTP ${res.status}`), rows: json.rows ?? [] }
}

// ── the run ──────────────────────────────────────────────────────────────────────────────────

interface Result {
  entry: Entry
  /** A's outcome: 'ok' or an error code. */
  outcome: string
  /** The backends the entry's hooks logged (none: the form ran no code of ours). */
  ranOn: number[]
  /**
   * shared: B was lent A's backend while A was connected (/sql: request 2 got request 1's);
   * after A ended: B got 53300 (A kept its backend), then A's backend once A ended; elsewhere: another backend.
   */
  seen: 'shared' | 'after A ended' | 'elsewhere'
  /** What B found that a fresh backend does not hold. */
  left: string[]
}

/** Superuser connections straight to Postgres: the setup, and reading the hooks' log. */
let admin: pg.Pool
let proxies: Proxy[] = []
let controlProxy: Proxy
let entries: Entry[] = []
const results: Result[] = []
const controls: Array<{ entry: Entry; outcome: string; before: string[]; shown: boolean }> = []
/** Entries and controls that threw or did not finish in ENTRY_MS. */
const failures: string[] = []
const baselines = {} as Record<EffectKey, Probe>
const logins = {} as Record<EffectKey, string[]>

/** The backends leave() logged running `entry`'s statement. */
async function ranOn(entry: Entry): Promise<number[]> {
  const { rows } = await admin.query(`SELECT DISTINCT pid FROM ${SCHEMA}.ran WHERE strpos(query, $1) > 0`, [entry.marker])
  return rows.map((r) => r.pid)
}

async function runEntry(p: Proxy, entry: Entry): Promise<Result> {
  const role = ROLES[entry.effect.key]
  if (entry.way === 'http') {
    const { outcome } = await post(p.port, role, entry.text, entry.values)
    const on = await ranOn(entry)
    const answer = await post(p.port, role, PROBE_SQL)
    if (answer.outcome !== 'ok') throw new Error(`the /sql probe failed: ${answer.outcome}`)
    const found: Probe = JSON.parse(answer.rows[0].probe)
    const left = differences(found, baselines[entry.effect.key])
    if (left.length) await clean(p, role)
    return { entry, outcome, ranOn: on, seen: on.includes(found.pid) ? 'shared' : 'elsewhere', left }
  }
  const b = await session(p.port, role)
  const a = entry.way === 'raw' ? await RawSession.open(p.port, logins[entry.effect.key]) : await session(p.port, role)
  try {
    const outcome = await send(a, entry)
    const on = await ranOn(entry)
    let found = await probe(b)
    let seen: Result['seen'] = 'shared'
    if (found === 'busy') {
      seen = 'after A ended'
      await a.end()
      for (let i = 0; i < 10 && found === 'busy'; i++) found = await probe(b)
      if (found === 'busy') throw new Error('B was never lent a backend, even after A ended')
    }
    if (!on.includes(found.pid)) seen = 'elsewhere'
    const left = differences(found, baselines[entry.effect.key])
    if (left.length) await b.query('DISCARD ALL') // (the next entry starts on a clean backend)
    return { entry, outcome, ranOn: on, seen, left }
  } finally {
    await Promise.all([a.end().catch(() => {}), b.end().catch(() => {})])
  }
}

/** Leaves the lane's backend of `role` clean, after a leak. */
async function clean(p: Proxy, role: string) {
  const c = await session(p.port, role)
  await c.query('DISCARD ALL').finally(() => c.end())
}

/** In session mode: the form, sent the entry's way, leaves its effect on its own session. */
async function runControl(p: Proxy, entry: Entry) {
  const a = entry.way === 'raw' ? await RawSession.open(p.port, logins[entry.effect.key]) : await session(p.port, ROLES[entry.effect.key])
  try {
    const before = differences((await probe(a)) as Probe, baselines[entry.effect.key])
    const outcome = await send(a, entry, entry.text.replace(entry.marker, '/* code-forms control */'))
    controls.push({ entry, outcome, before, shown: shows((await probe(a)) as Probe, entry.effect, SCHEMA) })
  } finally {
    await a.end()
  }
}

/** Runs `items` on `lanes` in parallel, each bound by ENTRY_MS; what fails goes to `failures`. */
async function inLanes(lanes: Proxy[], items: Entry[], run: (p: Proxy, e: Entry) => Promise<void>, what: string) {
  await Promise.all(
    lanes.map(async (p, lane) => {
      for (let i = lane; i < items.length; i += lanes.length) {
        const name = `${what} #${items[i].n} ${label(items[i])}`
        await within(ENTRY_MS, name, run(p, items[i])).catch((err: Error) => void failures.push(`${name}: ${err.message}`))
      }
    })
  )
}

before(async () => {
  admin = new pg.Pool({ ...pgConfig('scram_user'), max: 4 })
  for (const role of Object.values(ROLES)) await admin.query(`CREATE ROLE ${role} LOGIN PASSWORD '${PASSWORD}'`)
  for (const sql of setupSql(SCHEMA, ROLES)) await admin.query(sql).catch((err) => Promise.reject(new Error(`setup: ${err.message}\n${sql}`)))
  const oids = {} as Record<TypeKey, number>
  for (const t of TYPES) oids[t] = (await admin.query('SELECT $1::regtype::oid::int AS oid', [`${SCHEMA}.${t}`])).rows[0].oid
  entries = buildEntries(SCHEMA, oids)

  proxies = await Promise.all(Array.from({ length: LANES }, () => startProxy({ pool: { mode: 'transaction', size: 1, timeoutMs: 400 } })))
  controlProxy = await startProxy({ pool: { mode: 'session' } })
  for (const { key } of EFFECTS) {
    logins[key] = await clientLogin(proxies[0].port, ROLES[key])
    const fresh = await session(proxies[0].port, ROLES[key])
    baselines[key] = (await probe(fresh).finally(() => fresh.end())) as Probe
  }

  const started = performance.now()
  const wsEntries = entries.filter((e) => e.way !== 'http')
  await Promise.all([
    inLanes(proxies, entries, async (p, e) => void results.push(await runEntry(p, e)), 'entry'),
    inLanes([controlProxy, controlProxy], wsEntries, runControl, 'control of entry'),
  ])
  results.sort((x, y) => x.entry.n - y.entry.n)
  const count = (f: (r: Result) => boolean) => results.filter(f).length
  console.log(
    `code forms: ${FORMS.length} forms, ${entries.length} entries in ${((performance.now() - started) / 1000).toFixed(1)} s: ` +
      `${count((r) => r.seen === 'shared')} shared A's backend, ${count((r) => r.seen === 'after A ended')} after A ended, ` +
      `${count((r) => r.seen === 'elsewhere')} elsewhere; ${count((r) => r.left.length > 0)} leaked (${tally(results.filter((r) => r.left.length), (r) => r.entry.way)})`
  )
  console.log(`not expressible in PostgreSQL 18, left out:\n  ${NOT_EXPRESSIBLE.join('\n  ')}`)
  if (process.env.EDGEPG_CODE_FORMS_VERBOSE) {
    for (const r of results) console.log(`#${r.entry.n} ${label(r.entry)}: A ${r.outcome}, ran on ${r.ranOn.join(',') || 'nothing'}, ${r.seen}${r.left.length ? `, LEFT ${r.left.join('; ')}` : ''}`)
  }
})

after(async () => {
  await Promise.all([...proxies, controlProxy].map((p) => p?.close()))
  for (const sql of teardownSql(SCHEMA, ROLES)) await admin?.query(sql).catch((err) => console.error(`teardown: ${err.message}`))
  await admin?.end()
})

/** "key: count, …" of `rs` by `key`. */
function tally<T>(rs: T[], key: (r: T) => string): string {
  const counts = new Map<string, number>()
  for (const r of rs) counts.set(key(r), (counts.get(key(r)) ?? 0) + 1)
  return [...counts].map(([k, n]) => `${k}: ${n}`).join(', ') || 'none'
}

const label = (e: Entry) => `${e.form.name} [${e.form.node}] × ${e.effect.name} × ${e.way}`
const listing = (rs: Array<{ entry: Entry }>, detail: (r: any) => string) => rs.map((r) => `  #${r.entry.n} ${label(r.entry)}: ${detail(r)}`).join('\n')

test('every entry and control finishes', () => {
  assert.deepEqual(failures, [])
})

test("every form runs the attacker's function, every way it is sent", () => {
  const idle = results.filter((r) => r.outcome !== 'ok' || !r.ranOn.length)
  assert.equal(idle.length, 0, `entries that ran none of our code:\n${listing(idle, (r) => `A ${r.outcome}`)}`)
})

test('in a session of its own, every form leaves its effect (what B looks for is there to find)', () => {
  const missing = controls.filter((c) => c.outcome !== 'ok' || c.before.length || !c.shown)
  assert.equal(controls.length, entries.filter((e) => e.way !== 'http').length)
  assert.equal(missing.length, 0, `controls that did not show their effect:\n${listing(missing, (c) => `A ${c.outcome}; before: ${c.before.join('; ') || 'clean'}`)}`)
})

test('no form leaves anything for the next session on its backend', () => {
  const leaked = results.filter((r) => r.left.length)
  const forms = FORMS.flatMap((form) => {
    const rs = leaked.filter((r) => r.entry.form === form)
    if (!rs.length) return []
    const found = [...new Set(rs.map((r) => r.left.join('; ')))].join(' | ')
    return [`  ${form.name} [${form.node}]: ${rs.map((r) => `${r.entry.effect.key} × ${r.entry.way}`).join(', ')}\n      B found: ${found}`]
  })
  assert.equal(leaked.length, 0, `${leaked.length} of ${results.length} entries (${forms.length} of ${FORMS.length} forms) left state for the next session on their backend (by way: ${tally(leaked, (r) => r.entry.way)}):\n${forms.join('\n')}`)
})

test('the next session is lent the backend the form ran on (else the corpus proves nothing)', () => {
  const onA = results.filter((r) => r.seen !== 'elsewhere')
  assert.ok(onA.length >= results.length * 0.9, `only ${onA.length} of ${results.length} probes ran on A's backend:\n${listing(results.filter((r) => r.seen === 'elsewhere'), (r) => `ran on ${r.ranOn}`)}`)
  for (const way of ['simple', 'extended', 'raw', 'http'] satisfies Way[]) {
    const shared = results.filter((r) => r.entry.way === way && r.seen === 'shared').length
    assert.ok(shared > 0, `${way}: no probe was lent A's backend while A was connected`)
  }
})
