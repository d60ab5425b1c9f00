/**
 * Differential isolation, black box: a generated corpus (test/support/isolation-corpus.ts) of
 * statements that leave session state behind, disguised as an attacker would, and of innocent ones,
 * run by session A through a transaction-mode proxy with one backend (--pool-size 1, a short
 * --pool-timeout). While A stays connected, session B (same role, same proxy) asks the backend it
 * gets, in Postgres's own catalogs, what any session left there. The oracle is Postgres, not a
 * reading of SQL: if B runs on A's backend (same pg_backend_pid()), the backend must hold nothing of
 * A's. If B times out with 53300, A kept its backend (pinned): fine, and once A ends, a new session
 * must find that backend clean. Innocent entries must run, and must leave the proxy usable.
 *
 * Entries run in LANES, each a proxy of its own (one backend each), so pinned entries' waits overlap.
 * EDGEPG_CORPUS_VERBOSE=1 prints every entry's outcome.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Client, type ClientConfig } from '../src/index'
import { startProxy, edgeClient, scratchTable, within } from './support/helpers'
import { offeredLogin, RawSession } from './support/raw-session'
import { buildCorpus, findings, PROBE_SQL, settingName, type Entry, type Probe, type Step } from './support/isolation-corpus'

const APP = 'edgepg-isolation-corpus'
const LANES = 6
const POOL_TIMEOUT_MS = 250
/** Bound on one entry, whatever happens (a hang is a failure, not a stuck run). */
const ENTRY_MS = 15_000

type Proxy = Awaited<ReturnType<typeof startProxy>>

// ── sessions ─────────────────────────────────────────────────────────────────────────────────

async function session(port: number, extra: ClientConfig = {}): Promise<Client> {
  const client = edgeClient(port, 'scram_user', { application_name: APP, ...extra })
  client.on('error', () => {})
  await client.connect()
  return client
}

/** The subprotocols (the login in the upgrade among them) an edgepg Client offers the proxy at `port`. */
const clientLogin = (port: number) => offeredLogin((extra) => session(port, extra))

const codeOf = (err: any) => String(err?.code ?? err?.message ?? err)

/** Runs A's steps; the outcome of the entry: 'ok' or the first error's code. */
async function runSteps(a: Client | RawSession, steps: Step[]): Promise<string> {
  let outcome = 'ok'
  for (const step of steps) {
    let result: string
    if ('raw' in step) result = (await (a as RawSession).run(step.raw)).outcome
    else {
      const client = a as Client
      const query = step.extended || step.values ? { text: step.text, values: step.values ?? [], queryMode: 'extended' } : step.text
      result = await client.query(query as any).then(
        () => 'ok',
        (err: unknown) => codeOf(err)
      )
    }
    if (outcome === 'ok') outcome = result
  }
  return outcome
}

/** A's backend, seen from A (after a failed transaction, as a client would: ROLLBACK first). */
async function pidOf(a: Client | RawSession): Promise<number> {
  if (a instanceof RawSession) return a.pid()
  const ask = () => a.query('SELECT pg_backend_pid() AS pid').then((r) => r.rows[0].pid as number)
  return ask().catch(async (err: any) => {
    if (err.code !== '25P02') throw err
    await a.query('ROLLBACK')
    return ask()
  })
}

/**
 * B's look at the backend it is lent: the probe, or 'busy' (53300: no backend free in time). Any
 * other error rejects: B got no answer.
 */
async function probe(b: Client, names: string[]): Promise<Probe | 'busy'> {
  try {
    await b.query('BEGIN')
    const row = (await b.query(PROBE_SQL, [names])).rows[0]
    const lastval = await b.query('SELECT lastval()::text AS v').then(
      (r) => `value ${r.rows[0].v}`,
      (err) => codeOf(err)
    )
    await b.query('ROLLBACK')
    return { ...row, lastval }
  } catch (err) {
    if ((err as any).code === '53300') return 'busy'
    throw err
  }
}

// ── the run ──────────────────────────────────────────────────────────────────────────────────

interface Result {
  entry: Entry
  /** A's outcome: 'ok' or an error code. */
  outcome: string
  /** shared: B ran on A's backend; pinned: B got 53300; elsewhere: B ran on another backend. */
  seen: 'shared' | 'pinned' | 'elsewhere'
  /** What B found of A's on A's backend (shared), or after A ended (pinned/elsewhere). */
  found: string[]
  /** After A ended: whether a new session ran (the proxy stays usable). */
  usableAfter: boolean
  /** Custom settings left as '' (placeholders: not values, not findings). */
  emptied: string[]
}

async function runEntry(p: Proxy, entry: Entry, baseline: Probe, names: string[]): Promise<Result> {
  const b = await session(p.port)
  let b2: Client | undefined
  const a = entry.via === 'raw' ? await RawSession.open(p.port, loginProtocols) : await session(p.port)
  try {
    const outcome = await runSteps(a, entry.steps)
    // (undefined: A's session is gone. Whatever backend B gets must then hold nothing of it either.)
    const pidA = await pidOf(a).catch(() => undefined)
    let seenByB = await probe(b, names)
    // (An innocent entry's backend is due back at once: a second wait rules out a slow hand-back.)
    if (seenByB === 'busy' && !entry.leaves) seenByB = await probe(b, names)
    await b.end()
    let seen: Result['seen']
    let found: string[] = []
    let emptied: string[] = []
    if (seenByB === 'busy') seen = 'pinned'
    else if (pidA === undefined || seenByB.pid === pidA) {
      seen = 'shared'
      found = findings(seenByB, baseline).map((f) => `on A's backend while A is connected: ${f}`)
      emptied = seenByB.emptied
    } else seen = 'elsewhere'
    await a.end()
    // Once A has ended, its backend (reset, or a new one) must serve another session, clean.
    let usableAfter = true
    if (seen !== 'shared') {
      b2 = await session(p.port)
      let after: Probe | 'busy' = 'busy'
      for (let i = 0; i < 8 && after === 'busy'; i++) after = await probe(b2, names)
      if (after === 'busy') usableAfter = false
      else {
        found = findings(after, baseline).map((f) => `after A ended: ${f}`)
        emptied = after.emptied
      }
    }
    return { entry, outcome, seen, found, usableAfter, emptied }
  } finally {
    await Promise.all([a.end().catch(() => {}), b.end().catch(() => {}), b2?.end().catch(() => {})])
  }
}

let scratch: Awaited<ReturnType<typeof scratchTable>>
let sequence = ''
let proxies: Proxy[] = []
let corpus: Entry[] = []
const results: Result[] = []
let baseline: Probe
let loginProtocols: string[] = []

before(async () => {
  scratch = await scratchTable('isocorpus', 'x int')
  sequence = `${scratch.name}_seq`
  await scratch.tcp.query(`CREATE SEQUENCE ${sequence}`)
  const oid = async (signature: string) => (await scratch.tcp.query('SELECT $1::regprocedure::oid::int AS oid', [signature])).rows[0].oid as number
  corpus = buildCorpus({
    sequence,
    table: scratch.name,
    oids: {
      setConfig: await oid('set_config(text,text,boolean)'),
      advisoryLock: await oid('pg_advisory_lock(bigint)'),
      tryAdvisoryLock: await oid('pg_try_advisory_lock(bigint)'),
      backendPid: await oid('pg_backend_pid()'),
    },
  })
  const names = [...new Set(corpus.map((e) => settingName(e.n)))]
  proxies = await Promise.all(Array.from({ length: LANES }, () => startProxy({ pool: { mode: 'transaction', size: 1, timeoutMs: POOL_TIMEOUT_MS } })))
  loginProtocols = await clientLogin(proxies[0].port)
  // A clean backend, as B sees it through the proxy: what every probe is compared with.
  const first = await session(proxies[0].port)
  try {
    const seen = await probe(first, names)
    assert.notEqual(seen, 'busy', 'a fresh proxy lends its backend')
    baseline = seen as Probe
  } finally {
    await first.end()
  }
  const started = performance.now()
  await Promise.all(
    proxies.map(async (p, lane) => {
      for (let i = lane; i < corpus.length; i += LANES) {
        const entry = corpus[i]
        results[i] = await within(ENTRY_MS, `entry ${entry.n}`, runEntry(p, entry, baseline, names)).catch((err: Error) => ({
          entry,
          outcome: '?',
          seen: 'pinned' as const,
          found: [`the entry did not finish (B got no answer?): ${err.message}`],
          usableAfter: false,
          emptied: [],
        }))
      }
    })
  )
  const count = (f: (r: Result) => boolean) => results.filter(f).length
  console.log(
    `isolation corpus: ${corpus.length} entries in ${((performance.now() - started) / 1000).toFixed(1)} s: ` +
      `${count((r) => r.seen === 'pinned')} pinned, ${count((r) => r.seen === 'shared' && !r.found.length)} clean-shared, ` +
      `${count((r) => r.seen === 'elsewhere')} elsewhere, ${count((r) => r.found.length > 0)} leaked; ` +
      `innocent: ${count((r) => !r.entry.leaves)} (${count((r) => !r.entry.leaves && r.seen === 'pinned')} pinned)`
  )
  if (process.env.EDGEPG_CORPUS_VERBOSE) {
    for (const r of results) console.log(`entry ${r.entry.n} ${r.entry.name}: A ${r.outcome}, ${r.seen}${r.found.length ? ', LEAKED' : ''}`)
  }
  const emptied = new Set(results.flatMap((r) => r.emptied))
  console.log(
    `custom settings found as '' (a placeholder a session set, reset since: no value): ${emptied.size} names, ` +
      `seen by ${count((r) => r.emptied.length > 0)} probes; e.g. ${[...emptied].slice(0, 5).join(', ') || 'none'}`
  )
  console.log(`innocent entries pinned: ${tally(results.filter((r) => !r.entry.leaves && r.seen === 'pinned'), (r) => r.entry.name)}`)
  console.log(`elsewhere (B ran, on another backend): ${tally(results.filter((r) => r.seen === 'elsewhere'), (r) => r.entry.name)}`)
})

after(async () => {
  await Promise.all(proxies.map((p) => p.close()))
  await scratch?.tcp.query(`DROP SEQUENCE IF EXISTS ${sequence}`).catch(() => {})
  await scratch?.drop()
})

/** "key: count, …" of `rs` by `key`, most first. */
function tally(rs: Result[], key: (r: Result) => string): string {
  const counts = new Map<string, number>()
  for (const r of rs) counts.set(key(r), (counts.get(key(r)) ?? 0) + 1)
  return [...counts].sort((x, y) => y[1] - x[1]).map(([k, n]) => `${k}: ${n}`).join(', ') || 'none'
}

const listing = (rs: Result[], detail: (r: Result) => string) =>
  rs.map((r) => `  #${r.entry.n} ${r.entry.name}\n      ${JSON.stringify(r.entry.steps.map((s) => ('raw' in s ? `<raw ${s.raw.toString('hex')}>` : s.text)))}\n      ${detail(r)}`).join('\n')

test('no entry leaves state on a backend another session is lent', () => {
  const leaked = results.filter((r) => r.found.length)
  const by = (key: (r: Result) => string) => tally(leaked, key)
  const summary = `by disguise: ${by((r) => `${r.entry.disguise} (${r.entry.via})`)}\nby payload: ${by((r) => r.entry.payload)}`
  assert.equal(leaked.length, 0, `${leaked.length} of ${results.length} entries let state through\n${summary}\n${listing(leaked, (r) => `(A: ${r.outcome}, ${r.seen}) ${r.found.join('; ')}`)}`)
})

test('innocent entries run', () => {
  const failed = results.filter((r) => !r.entry.leaves && r.outcome !== r.entry.expect)
  assert.equal(failed.length, 0, `innocent entries that failed:\n${listing(failed, (r) => r.outcome)}`)
})

test('after every entry, once its session ends, the proxy serves the next session', () => {
  const stuck = results.filter((r) => !r.usableAfter)
  assert.equal(stuck.length, 0, `entries after which no session was served:\n${listing(stuck, (r) => `(A: ${r.outcome}, ${r.seen})`)}`)
})

test('the corpus reaches shared backends: a plain SELECT 1 gives its backend back', () => {
  const plain = results.filter((r) => r.entry.payload === 'SELECT 1' && r.entry.disguise === 'plain')
  assert.ok(plain.length >= 2)
  assert.deepEqual(plain.map((r) => `${r.entry.via}: ${r.seen}`), plain.map((r) => `${r.entry.via}: shared`))
})
