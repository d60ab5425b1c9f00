/**
 * `npm start`'s demo, end to end: demo/start.ts as a child process (as `npm start` runs it, after
 * the build `npm test` has done), on a temp data directory and free ports, driven in headless
 * Chromium. Checks the rows the SQL console renders from the seeded shop, the round trips its
 * waterfall counts (the budget in docs/how-it-works.md: the WebSocket upgrade carrying the login, then one flight), that the
 * injected delay is real, that Ctrl-C stops everything (Postgres included) with exit code 0, and
 * that a second start reuses the data.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, type ChildProcess } from 'node:child_process'
import { chmod, mkdtemp, readFile, rm } from 'node:fs/promises'
import net from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import pg from 'pg'
import type { Browser, Page } from 'playwright-core'
import { launchChromium } from './support/chromium'
import { same, within } from './support/helpers'
import { freePort } from './support/stack'

const SEEDED_CUSTOMERS = 12

interface Demo {
  child: ChildProcess
  output: () => string
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>
}

let dir: string
let dataDir: string
let ports: { port: number; proxyPort: number; pgPort: number }
let browser: Browser | undefined
let page: Page
let demo: Demo | undefined
/** The SQL console's address, as the demo printed it. */
let consoleAt: string
/** Postmasters started by the demos, so after() can make sure none outlives the test. */
const postmasters = new Set<number>()

/**
 * Starts demo/start.ts in its own process group (so a signal to the group is what Ctrl-C in a
 * terminal sends: to tsx, node and Postgres alike).
 */
function startDemo(extraArgs: string[] = [], env: Record<string, string> = {}): Demo {
  // As `npm start` runs it: one node process (tsx's CLI would stand between it and the signal, and
  // under load relayed SIGTERM as its own exit 143).
  const child = spawn(process.execPath, ['--import', 'tsx', 'demo/start.ts', ...extraArgs], {
    detached: true,
    stdio: ['ignore', 'pipe', 'pipe'],
    env: {
      ...process.env,
      EDGEPG_DEMO_DATA: dataDir,
      EDGEPG_DEMO_PORT: String(ports.port),
      EDGEPG_DEMO_PROXY_PORT: String(ports.proxyPort),
      EDGEPG_DEMO_PG_PORT: String(ports.pgPort),
      ...env,
    },
  })
  let out = ''
  child.stdout!.on('data', (c) => (out += c))
  child.stderr!.on('data', (c) => (out += c))
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => child.once('exit', (code, signal) => resolve({ code, signal })))
  return { child, output: () => out, exited }
}

/** The console's URL, once the demo printed it. */
async function consoleUrl(d: Demo): Promise<string> {
  const found = await within(120_000, 'the demo printing its SQL console URL', (async () => {
    for (;;) {
      const m = /SQL console\s+(http:\/\/\S+)/.exec(d.output())
      if (m) return m[1]
      const exit = await Promise.race([d.exited, new Promise((r) => setTimeout(r, 50, undefined))])
      if (exit) throw new Error(`the demo exited early (${JSON.stringify(exit)}):\n${d.output()}`)
    }
  })())
  const pid = Number((await readFile(join(dataDir, 'postmaster.pid'), 'utf8')).split('\n')[0])
  postmasters.add(pid)
  return found
}

const alive = (pid: number) => {
  try {
    process.kill(pid, 0)
    return true
  } catch {
    return false
  }
}

/** Whether something accepts TCP connections on the port. */
const accepts = (port: number) =>
  new Promise<boolean>((resolve) => {
    const s = net.connect({ host: '127.0.0.1', port })
    s.once('connect', () => (s.destroy(), resolve(true)))
    s.once('error', () => resolve(false))
  })

/** Sends `signal` to the demo's process group; resolves with its exit once it has stopped. */
async function stopDemo(d: Demo, signal: NodeJS.Signals) {
  process.kill(-d.child.pid!, signal)
  return within(20_000, `the demo exiting after ${signal}`, d.exited)
}

interface RunResult {
  state: string
  headers: string[]
  rows: string[][]
  error: string
  run: Record<string, string>
  flights: Array<{ dir: string; messages: string; startMs: number; endMs: number }>
  roundTripsShown: string | undefined
}

/** Runs `sql` in the console over `transport` with `rtt` ms of added delay; reads what it shows. */
async function runQuery(sql: string, transport: 'ws' | 'ws-e2e' | 'http', rtt = 0): Promise<RunResult> {
  await page.fill('#sql', sql)
  await page.check(`input[name=transport][value=${transport}]`)
  await page.check(`input[name=rtt][value="${rtt}"]`)
  const previous = await page.evaluate(() => Number(document.querySelector<HTMLElement>('#status')!.dataset.runId ?? 0))
  await page.click('#run')
  await page.waitForFunction(
    (n) => {
      const s = document.querySelector<HTMLElement>('#status')!
      return Number(s.dataset.runId) > n && s.dataset.state !== 'running'
    },
    previous,
    { timeout: 30_000 }
  )
  return page.evaluate(() => {
    const run = document.querySelector<HTMLElement>('#runs [data-run]')!
    return {
      state: document.querySelector<HTMLElement>('#status')!.dataset.state!,
      headers: Array.from(document.querySelectorAll('#rows table thead th'), (th) => th.textContent!),
      rows: Array.from(document.querySelectorAll<HTMLTableRowElement>('#rows table tbody tr'), (tr) => Array.from(tr.cells, (c) => c.textContent!)),
      error: document.querySelector<HTMLElement>('#error')!.hidden ? '' : document.querySelector('#error')!.textContent!,
      run: { ...run.dataset } as Record<string, string>,
      flights: Array.from(run.querySelectorAll<HTMLElement>('[data-flight]'), (f) => ({
        dir: f.dataset.dir!,
        messages: f.dataset.messages!,
        startMs: Number(f.dataset.startMs),
        endMs: Number(f.dataset.endMs),
      })),
      roundTripsShown: document.querySelector<HTMLElement>('#round-trips')!.dataset.count,
    }
  })
}

const CUSTOMERS_SQL = 'SELECT id, name, city FROM customers ORDER BY id LIMIT 3'
const FIRST_CUSTOMERS = [
  ['1', 'Ada Lovelace', 'London'],
  ['2', 'Grace Hopper', 'New York'],
  ['3', 'Alan Turing', 'Manchester'],
]
/** A flight's message names without repeats, e.g. 'AuthenticationOk,ParameterStatus,…' → a Set. */
const names = (f: { messages: string }) => new Set(f.messages.split(','))

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'edgepg-demo-'))
  await chmod(dir, 0o755) // the postgres user must reach the data directory inside
  dataDir = join(dir, 'data')
  ports = { port: await freePort(), proxyPort: await freePort(), pgPort: await freePort() }
  demo = startDemo()
  const [url, b] = await Promise.all([consoleUrl(demo), launchChromium()])
  consoleAt = url
  browser = b
  page = await browser.newPage()
  const errors: string[] = []
  page.on('pageerror', (e) => errors.push(e.message))
  await page.goto(url)
  await page.waitForSelector('form[data-ready]', { timeout: 15_000 }).catch((err) => {
    throw new Error(`the console did not load: ${err.message}; page errors: ${errors.join('; ')}`)
  })
})

after(async () => {
  await browser?.close()
  if (demo && demo.child.exitCode === null && demo.child.signalCode === null) {
    try {
      process.kill(-demo.child.pid!, 'SIGKILL')
    } catch {}
  }
  // A demo killed before it stopped its Postgres leaves the postmaster running: stop it (immediate shutdown).
  const pidFile = await readFile(join(dataDir, 'postmaster.pid'), 'utf8').catch(() => '')
  if (pidFile) postmasters.add(Number(pidFile.split('\n')[0]))
  for (const pid of postmasters) if (alive(pid)) process.kill(pid, 'SIGQUIT')
  await rm(dir, { recursive: true, force: true })
})

test('the demo initialises a fresh data directory and seeds it, and prints a superuser URL that logs in', async () => {
  assert.match(demo!.output(), /data: .*\(new, seeded with a sample shop\)/, `first start should say it seeded:\n${demo!.output()}`)
  const url = /superuser\s+(postgres:\/\/\S+)/.exec(demo!.output())?.[1]
  assert.ok(url, demo!.output())
  const admin = new pg.Client(url)
  await admin.connect()
  try {
    assert.deepEqual((await admin.query('SELECT rolsuper FROM pg_roles WHERE rolname = current_user')).rows, [{ rolsuper: true }])
  } finally {
    await admin.end()
  }
})

test('the console warms the driver and the proxy before it says it is ready: a session over each WebSocket transport, and a warm backend for its login', async () => {
  const metrics = await (await fetch(`http://127.0.0.1:${ports.proxyPort}/metrics`)).text()
  const value = (name: string) => Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(metrics)?.[1])
  assert.equal(value('edgepg_proxy_sessions_total\\{outcome_kind="ok"\\}'), 2, 'the warm-up sessions, before any run')
  assert.ok(value('edgepg_proxy_pool_backends') >= 1, 'a backend kept for the console\'s login')
  assert.equal(await page.evaluate(() => document.querySelector('#status')!.textContent), 'Pick a transport and a delay, then run the query.')
})

test('Client: the seeded rows; the login rides in the WebSocket upgrade, then one round trip for the query', async () => {
  const r = await runQuery(CUSTOMERS_SQL, 'ws')
  assert.equal(r.state, 'done', `the run failed: ${r.error}`)
  same(r.headers, ['id', 'name', 'city'], 'column headers')
  same(r.rows, FIRST_CUSTOMERS, 'rows')
  same(r.flights.map((f) => f.dir), ['connect', 'in', 'out', 'in'], 'flights: the upgrade and its answer, then the query and its result')
  same([...names(r.flights[0])], ['WebSocket upgrade', 'StartupMessage', 'PasswordMessage'], 'the upgrade carried the startup and the password')
  for (const m of ['AuthenticationOk', 'BackendKeyData', 'ReadyForQuery']) assert.ok(names(r.flights[1]).has(m), `the upgrade's answer should hold ${m}: ${r.flights[1].messages}`)
  same([...names(r.flights[2])], ['Query'], 'the flight out: the query alone')
  for (const m of ['RowDescription', 'DataRow', 'CommandComplete', 'ReadyForQuery']) {
    assert.ok(names(r.flights[3]).has(m), `the flight back should hold ${m}: ${r.flights[3].messages}`)
  }
  assert.equal(r.run.roundTrips, '2', `round trips (upgrade + 1), got ${r.run.roundTrips}`)
  assert.equal(r.run.afterOpen, '1', `round trips after the WebSocket opened, got ${r.run.afterOpen}`)
  assert.equal(r.roundTripsShown, '2', `#round-trips should show the latest run's count, got ${r.roundTripsShown}`)
})

test('Client with SCRAM end to end (authOffload: false): one round trip per SASL step, strictly more than with the proxy doing it', async () => {
  const r = await runQuery(CUSTOMERS_SQL, 'ws-e2e')
  assert.equal(r.state, 'done', `the run failed: ${r.error}`)
  same(r.rows, FIRST_CUSTOMERS, 'rows')
  same(r.flights.map((f) => f.dir), ['connect', 'in', 'out', 'in', 'out', 'in', 'out', 'in'], 'flights')
  same([...names(r.flights[0])], ['WebSocket upgrade', 'StartupMessage'], 'the upgrade carried the startup, no password')
  same(r.flights.filter((f) => f.dir === 'out').map((f) => f.messages), ['PasswordMessage', 'PasswordMessage', 'Query'], 'SASLInitialResponse, SASLResponse (PasswordMessage frames), then the query, each after the answer to the one before')
  assert.equal(r.run.roundTrips, '4', `round trips: upgrade + two SASL steps + query, got ${r.run.roundTrips}`)
})

test('HTTP sql: the same rows in one round trip', async () => {
  const r = await runQuery(CUSTOMERS_SQL, 'http')
  assert.equal(r.state, 'done', `the run failed: ${r.error}`)
  same(r.headers, ['id', 'name', 'city'], 'column headers')
  same(r.rows, FIRST_CUSTOMERS, 'rows')
  same(r.flights.map((f) => f.dir), ['out', 'in'], 'one request, one response')
  assert.equal(r.run.roundTrips, '1', `round trips over HTTP, got ${r.run.roundTrips}`)
})

test('the injected delay is real: each round trip costs the chosen RTT', async (t) => {
  const RTT = 200
  for (const [transport, trips] of [['ws', 2], ['ws-e2e', 4], ['http', 1]] as const) {
    const r = await runQuery(CUSTOMERS_SQL, transport, RTT)
    assert.equal(r.state, 'done', `${transport} at ${RTT} ms failed: ${r.error}`)
    same(r.rows, FIRST_CUSTOMERS, `${transport} rows at ${RTT} ms`)
    assert.equal(r.run.roundTrips, String(trips), `${transport} round trips at ${RTT} ms, got ${r.run.roundTrips}`)
    const total = Number(r.run.durationMs)
    t.diagnostic(`${transport} at ${RTT} ms RTT: ${trips} round trips, first result after ${total} ms`)
    assert.ok(total >= RTT * trips, `${transport}: ${trips} round trips at ${RTT} ms RTT took ${total} ms, expected ≥ ${RTT * trips}`)
    assert.ok(total < RTT * (trips + 1) + 500, `${transport}: ${total} ms is far more than ${trips} round trips of ${RTT} ms`)
    // Every answer comes at least one RTT after the flight it answers.
    r.flights.forEach((f, i) => {
      if (f.dir === 'connect') assert.ok(f.endMs - f.startMs >= RTT, `${transport}: the WebSocket opened after ${f.endMs - f.startMs} ms, expected ≥ ${RTT}`)
      if (f.dir === 'in') assert.ok(f.startMs - r.flights[i - 1].startMs >= RTT, `${transport}: flight ${i} came ${f.startMs - r.flights[i - 1].startMs} ms after the one it answers, expected ≥ ${RTT}`)
    })
  }
})

test('Compare all three ends with one table: each transport, its round trips and milliseconds, above the rows', async () => {
  await page.fill('#sql', CUSTOMERS_SQL)
  await page.check('input[name=rtt][value="0"]')
  await page.click('#compare')
  await page.waitForSelector('#rows #comparison', { timeout: 60_000 })
  const { rows, next } = await page.evaluate(() => ({
    rows: Array.from(document.querySelectorAll<HTMLTableRowElement>('#comparison tbody tr'), (tr) => [tr.dataset.transport, tr.dataset.roundTrips, tr.cells[2].textContent]),
    next: document.querySelector('#comparison')!.nextElementSibling?.tagName,
  }))
  same(rows.map(([t, n]) => [t, n]), [['ws', '2'], ['ws-e2e', '4'], ['http', '1']], 'transports and round trips, in the order run')
  for (const [, , ms] of rows) assert.match(ms!, /^\d+ ms$/)
  assert.equal(next, 'TABLE', "the last run's rows follow")
})

test('Compare all three: a run that failed says why in its row, and the others their rows', async () => {
  await page.fill('#sql', 'SELECT * FROM no_such_table')
  await page.click('#compare')
  await page.waitForFunction(() => document.querySelectorAll('#comparison tbody tr').length === 3 && document.querySelector('#comparison td.error'), undefined, { timeout: 60_000 })
  const outcomes = await page.evaluate(() => Array.from(document.querySelectorAll<HTMLTableRowElement>('#comparison tbody tr'), (tr) => [tr.dataset.transport, tr.cells[1].textContent, tr.cells[3].textContent]))
  same(outcomes, ['ws', 'ws-e2e', 'http'].map((t) => [t, 'failed', 'ERROR 42P01: relation "no_such_table" does not exist']), 'each transport failed, saying why')
  await page.fill('#sql', CUSTOMERS_SQL)
})

test("a Postgres error is shown with its SQLSTATE, and the waterfall still draws the run", async () => {
  const r = await runQuery('SELECT * FROM no_such_table', 'ws')
  assert.equal(r.state, 'error', `the run should fail, state ${r.state}`)
  assert.match(r.error, /42P01.*no_such_table/, `error text: ${r.error}`)
  assert.equal(r.rows.length, 0, `no rows should be shown, got ${JSON.stringify(r.rows)}`)
  assert.ok(r.flights.some((f) => names(f).has('ErrorResponse')), `the flight back should hold the ErrorResponse: ${JSON.stringify(r.flights)}`)
})

test('live notifications: the page LISTENs, and a NOTIFY run in the console arrives in its list', async () => {
  await page.fill('#channel', 'orders')
  await page.click('#listen')
  await page.waitForSelector('#live[data-listening="orders"]', { timeout: 15_000 })
  const r = await runQuery("NOTIFY orders, 'order 42 shipped'", 'ws')
  assert.equal(r.state, 'done', `the NOTIFY failed: ${r.error}`)
  await page.waitForFunction(() => document.querySelector('#notifications li.notification'), undefined, { timeout: 15_000 })
  const first = await page.evaluate(() => Array.from(document.querySelectorAll('#notifications li.notification:first-child span'), (s) => [s.className, s.textContent]))
  same(first.filter(([c]) => c === 'channel' || c === 'payload'), [['channel', 'orders'], ['payload', 'order 42 shipped']], 'the notification shown')
})

test('signed-in users: no database password in the page; each sees their own orders by token, over a WebSocket and over HTTP', async () => {
  const context = await browser!.newContext()
  const p = await context.newPage()
  const bodies: string[] = []
  // What the page was sent, the driver's code aside: the page, its data, the sign-in's answers, /sql's.
  p.on('response', (r) => void (/\.(m?js|css)$/.test(new URL(r.url()).pathname) || r.text().then((t) => bodies.push(t), () => {})))
  try {
    await p.goto(new URL('/users.html', consoleAt).href)
    await p.waitForSelector('form[data-ready]', { timeout: 15_000 })
    const seen: Record<string, string[]> = {}
    for (const transport of ['ws', 'http']) {
      await p.check(`input[name=transport][value=${transport}]`)
      for (const [user, name] of [['ada', 'Ada Lovelace'], ['grace', 'Grace Hopper'], ['ada', 'Ada Lovelace']]) {
        await p.click(`button[data-user=${user}]`)
        await p.waitForFunction((u) => {
          const s = document.querySelector<HTMLElement>('#status')!
          return (s.dataset.state === 'done' && s.dataset.user === u) || s.dataset.state === 'error'
        }, user, { timeout: 30_000 })
        const { state, error, customers, orders, pressed, ms } = await p.evaluate(() => ({
          state: document.querySelector<HTMLElement>('#status')!.dataset.state,
          pressed: Array.from(document.querySelectorAll<HTMLElement>('#people button[aria-pressed=true]'), (b) => b.dataset.user),
          ms: document.querySelector<HTMLElement>('#status')!.dataset.ms,
          error: document.querySelector('#error')!.textContent,
          customers: Array.from(document.querySelectorAll<HTMLTableRowElement>('#rows tbody tr'), (tr) => tr.cells[0].textContent!),
          orders: Array.from(document.querySelectorAll<HTMLTableRowElement>('#rows tbody tr'), (tr) => tr.cells[1].textContent!),
        }))
        assert.equal(state, 'done', `${user} over ${transport}: ${error}`)
        assert.deepEqual(pressed, [user], 'who is signed in is highlighted, and only they')
        assert.match(ms ?? '', /^\d+$/, 'the query\'s time is shown')
        assert.ok(customers.length > 0, `${user} sees orders`)
        assert.deepEqual([...new Set(customers)], [name], `${user} over ${transport} sees only their own orders`)
        seen[`${user} ${transport}`] = orders
      }
    }
    assert.deepEqual(seen['ada ws'], seen['ada http'])
    assert.ok(seen['ada ws'].every((o) => !seen['grace ws'].includes(o)), 'no order of one is the other\'s')
    // No password reached the page: not the role's the proxy logs in with, not the console's.
    const rolePassword = (await readFile(join(dir, 'pgpass'), 'utf8')).trim().split(':').pop()!
    const everything = [await p.content(), ...bodies].join('\n')
    assert.ok(!everything.includes(rolePassword), "the role's password is in the page")
    assert.ok(!/"password"|demo:demo@/.test(everything), 'a password field or connection string reached the page')
  } finally {
    await context.close()
  }
})

test('Ctrl-C stops the proxy, the console and Postgres, and exits 0', async () => {
  // Written now, read back after the next start.
  const r = await runQuery("INSERT INTO customers (name, email, city, joined_at) VALUES ('Persisted Person', 'persisted@example.com', 'Nowhere', '2025-01-01') RETURNING name", 'http')
  assert.equal(r.state, 'done', `insert failed: ${r.error}`)
  await page.goto('about:blank')
  const exit = await stopDemo(demo!, 'SIGINT')
  same(exit, { code: 0, signal: null }, `exit after SIGINT; output:\n${demo!.output()}`)
  for (const pid of postmasters) assert.ok(!alive(pid), `postmaster ${pid} still runs after the demo exited`)
  for (const [name, port] of Object.entries(ports)) assert.ok(!(await accepts(port)), `${name} ${port} still accepts connections`)
})

test('a second start reuses the data directory: no new seed, earlier writes kept; SIGTERM stops it', async () => {
  demo = startDemo()
  await consoleUrl(demo)
  assert.match(demo.output(), /data: .*\(reused\)/, `second start should reuse the data:\n${demo.output()}`)
  const c = new pg.Client({ host: '127.0.0.1', port: ports.pgPort, user: 'demo', password: 'demo', database: 'shop' })
  await c.connect()
  try {
    const { rows } = await c.query("SELECT count(*)::int AS n, count(*) FILTER (WHERE name = 'Persisted Person')::int AS kept FROM customers")
    same(rows[0], { n: SEEDED_CUSTOMERS + 1, kept: 1 }, 'customers after a restart: the seed once, plus the row inserted before')
  } finally {
    await c.end()
  }
  const exit = await stopDemo(demo, 'SIGTERM')
  same(exit, { code: 0, signal: null }, `exit after SIGTERM; output:\n${demo.output()}`)
  for (const pid of postmasters) assert.ok(!alive(pid), `postmaster ${pid} still runs after the demo exited`)
})

test('a busy port stops the demo before anything starts, naming the port and the flag to change it', async () => {
  const holder = net.createServer()
  await new Promise<void>((resolve) => holder.listen(0, '127.0.0.1', resolve))
  const busy = (holder.address() as net.AddressInfo).port
  try {
    demo = startDemo(['--proxy-port', String(busy)])
    const exit = await within(20_000, 'the demo refusing a busy port', demo.exited)
    same(exit, { code: 1, signal: null }, `exit with a busy port; output:\n${demo.output()}`)
    assert.match(demo.output(), new RegExp(`port ${busy} .*already in use.*--proxy-port`), `message: ${demo.output()}`)
    assert.ok(!(await accepts(ports.pgPort)), 'no Postgres should have been started')
  } finally {
    holder.close()
  }
})
