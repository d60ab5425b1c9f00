/**
 * The built bundle in a real browser: headless Chromium (Debian's, via test/support/chromium.ts) opens a
 * page from a small static server on http://127.0.0.1:<port>, which imports dist/index.mjs (an ES
 * module with relative imports of dist/chunks/) and runs the shared checks (test/runtimes/checks.js:
 * Client, Pool, the login in the upgrade, httpSql) with the browser's own WebSocket and fetch, against the
 * test Postgres through an in-process edgepg-proxy on another port.
 *
 * So the page is cross-origin to the proxy: its WebSockets carry an `Origin` header, and httpSql's
 * POST /sql (JSON body, Neon-* headers) is preceded by a CORS preflight. The proxy refuses browser
 * Origins it has not been told about (the default is none), so the proxy here allows the page's;
 * the second test shows a proxy with the default refusing that same page on both routes.
 * `npm test` builds dist/ first.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http, { type Server } from 'node:http'
import { readFile } from 'node:fs/promises'
import type { AddressInfo } from 'node:net'
import { resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import type { Browser, Page } from 'playwright-core'
import { launchChromium } from './support/chromium'
import { startProxy, testPostgres, within } from './support/helpers'
import { PASSWORD } from './support/stack'
import type { SqlLog } from '../proxy/sql/handler'
import { assertChecks } from './runtimes/assert-checks'
import { token, tokenFixture } from './support/tokens'
import { replicaFixture } from './support/standby'

const DIST = fileURLToPath(new URL('../dist/', import.meta.url)) // ends with a separator
const CHECKS = fileURLToPath(new URL('./runtimes/checks.js', import.meta.url))
const TIMEOUT_MS = 30_000

/** The page: no scripts but the shared checks (a plain script); the test imports the bundle into it. */
const PAGE = `<!doctype html>
<meta charset="utf-8">
<link rel="icon" href="data:,">
<title>edgepg in Chromium</title>
<script src="/checks.js"></script>
`

// What runs in the page is plain JavaScript text, called with JSON arguments (`inPage`): functions
// written here would be compiled by tsx, whose helpers (e.g. __name) do not exist in the page.

/** Before the bundle is imported (it may install stand-ins of its own): which globals the page has. */
const PAGE_ENV = `() => ({
  userAgent: navigator.userAgent,
  process: typeof process,
  Buffer: typeof Buffer,
  require: typeof require,
  WebSocket: typeof WebSocket,
  fetch: typeof fetch,
  checks: typeof globalThis.edgepgChecks,
})`

/** Imports the bundle and runs the shared checks with the page's own WebSocket and fetch. */
const RUN_CHECKS = `async ({ url, options }) => {
  try {
    const mod = await import(url)
    return { ok: true, out: await globalThis.edgepgChecks(mod, options) }
  } catch (err) {
    return { ok: false, error: String(err?.stack ?? err) }
  }
}`

/** A Client connect and an httpSql query, each resolving with how it failed. */
const TRY_REFUSED = `async ({ url, options }) => {
  const { Client, httpSql } = await import(url)
  const { proxyPort, host, port, database, password } = options
  const failure = (p) => p.then(() => 'no error', (err) => err?.name + ': ' + err?.message)
  const client = new Client({ host, port, database, user: 'scram_user', password, wsProxy: () => 'ws://127.0.0.1:' + proxyPort + '/v2' })
  const sql = httpSql('postgresql://scram_user:' + encodeURIComponent(password) + '@' + host + ':' + port + '/' + database, {
    fetchEndpoint: 'http://127.0.0.1:' + proxyPort + '/sql',
  })
  const elsewhere = new Client({ host, port, database, user: 'scram_user', password, wsProxy: () => 'ws://127.0.0.1:' + proxyPort + '/v3' })
  return { client: await failure(client.connect()), http: await failure(sql\`SELECT 1\`), wrongPath: await failure(elsewhere.connect()) }
}`

/** Calls one of the functions above in the page with `arg`; resolves with its (JSON) result. */
const inPage = (page: Page, fn: string, arg?: unknown): Promise<any> => page.evaluate(`(${fn})(${JSON.stringify(arg ?? null)})`)

const TYPES: Record<string, string> = { '.mjs': 'text/javascript', '.js': 'text/javascript' }

interface Served {
  path: string
  status: number
  type?: string
}

/**
 * Serves PAGE at /, checks.js at /checks.js and the JavaScript files of dist/ under /dist/ (nothing
 * outside dist/) as text/javascript, and records what it served.
 */
function staticServer() {
  const served: Served[] = []
  const server: Server = http.createServer((req, res) => {
    const path = new URL(req.url ?? '/', 'http://static').pathname
    const send = (status: number, type: string | undefined, body: string | Buffer) => {
      served.push({ path, status, type })
      res.writeHead(status, { 'content-type': type ?? 'text/plain', 'cache-control': 'no-store' })
      res.end(body)
    }
    if (req.method !== 'GET') return send(405, undefined, 'GET only\n')
    if (path === '/') return send(200, 'text/html; charset=utf-8', PAGE)
    const file = path === '/checks.js' ? CHECKS : path.startsWith('/dist/') ? resolve(DIST, decodeURIComponent(path.slice('/dist/'.length))) : undefined
    const type = file && TYPES[file.slice(file.lastIndexOf('.'))]
    if (!file || !(file === CHECKS || file.startsWith(DIST)) || !type) return send(404, undefined, `not found: ${path}\n`)
    readFile(file).then(
      (body) => send(200, type, body),
      () => send(404, undefined, `not found: ${path}\n`)
    )
  })
  return { server, served }
}

let browser: Browser | undefined
let site: ReturnType<typeof staticServer>
let origin: string
const proxies: Array<Awaited<ReturnType<typeof startProxy>>> = []
/** Logins by token: the roles, the table of rows per user, setup-auth (test/support/tokens.ts). */
let fixture: Awaited<ReturnType<typeof tokenFixture>>
/** A primary of its own with a lagging standby (test/support/standby.ts). */
let replicas: Awaited<ReturnType<typeof replicaFixture>>
const TABLE = `browser_notes_${process.pid}`

before(async () => {
  site = staticServer()
  await new Promise<void>((ok) => site.server.listen(0, '127.0.0.1', ok))
  origin = `http://127.0.0.1:${(site.server.address() as AddressInfo).port}`
  fixture = await tokenFixture(TABLE)
  replicas = await replicaFixture('browser-primary')
  browser = await within(TIMEOUT_MS, 'Chromium to start', launchChromium())
})

after(async () => {
  await browser?.close()
  await Promise.all(proxies.map((p) => p.close()))
  await fixture?.teardown()
  await replicas?.teardown()
  site?.server.closeAllConnections()
  await new Promise((ok) => (site?.server.listening ? site.server.close(ok) : ok(undefined)))
})

/** An edgepg-proxy for this file (closed in after()), logging its /sql requests into `sqlLogs`. */
async function proxyFor(options: Parameters<typeof startProxy>[0] = {}) {
  const sqlLogs: SqlLog[] = []
  const proxy = await startProxy({ ...options, sqlLog: (entry) => sqlLogs.push(entry) })
  proxies.push(proxy)
  return { proxy, sqlLogs }
}

/**
 * A fresh page at the static site. `report()` gives what it logged (console, page errors, failed
 * requests) and what the site served; `problems` holds its console errors and page errors.
 */
async function openPage(): Promise<{ page: Page; problems: string[]; report: () => string; close: () => Promise<void> }> {
  assert.ok(browser, 'Chromium is running')
  const context = await browser.newContext()
  const page = await context.newPage()
  page.setDefaultTimeout(TIMEOUT_MS)
  const problems: string[] = []
  const log: string[] = []
  site.served.length = 0
  const note = (line: string, problem = false) => (log.push(line), problem && problems.push(line))
  page.on('console', (m) => note(`console.${m.type()}: ${m.text()}`, m.type() === 'error'))
  page.on('pageerror', (err) => note(`page error: ${err.stack ?? err.message}`, true))
  page.on('requestfailed', (r) => note(`request failed: ${r.method()} ${r.url()}: ${r.failure()?.errorText}`))
  const report = () => `page console and errors:\n${log.join('\n') || '(none)'}\nserved: ${JSON.stringify(site.served)}`
  const response = await bounded(`loading ${origin}/`, page.goto(`${origin}/`), report)
  assert.equal(response?.status(), 200, `${origin}/ loaded; ${report()}`)
  return { page, problems, report, close: () => context.close() }
}

/** Bounds `promise`; on a timeout the error also says what the page reported by then. */
const bounded = <T>(what: string, promise: Promise<T>, report: () => string) =>
  within(TIMEOUT_MS, what, promise).catch((err: Error) => {
    err.message += `\n${report()}`
    throw err
  })

/** The checks' options for a proxy on `proxyPort` (and one taking tokens on `tokens.proxyPort`). */
const checkOptions = (proxyPort: number, tokens?: object, replica?: object) => ({ proxyPort, ...testPostgres(), password: PASSWORD, tokens, replica })

test('Chromium runs dist/index.mjs with its own WebSocket and fetch: Client, Pool, the login in the upgrade, httpSql (CORS)', async () => {
  const { proxy, sqlLogs } = await proxyFor({ allowedOrigins: [origin] })
  const { page, problems, report, close } = await openPage()
  try {
    // Before the bundle is imported (it may install stand-ins of its own): a browser, not Node.
    const env: Record<string, string> = await inPage(page, PAGE_ENV)
    assert.match(env.userAgent, /\b(Headless)?Chrome\/\d+/, `a Chromium user agent; ${report()}`)
    assert.ok(env.process === 'undefined' && env.Buffer === 'undefined' && env.require === 'undefined', `no process, Buffer or require before the bundle loads: ${JSON.stringify(env)}`)
    assert.ok(env.WebSocket === 'function' && env.fetch === 'function', `the browser's own WebSocket and fetch: ${JSON.stringify(env)}`)
    assert.equal(env.checks, 'function', `checks.js loaded as a plain script; ${report()}`)

    const { proxy: byToken } = await proxyFor({ allowedOrigins: [origin], tokens: fixture.options, pool: { listenPolicy: fixture.listenPolicy } })
    const tokens = { proxyPort: byToken.port, table: TABLE, alice: await token('alice', { seconds: 600 }), bob: await token('bob', { seconds: 600 }) }
    const { proxy: withReplica } = await proxyFor({ allowedOrigins: [origin], upstream: replicas.upstream, replicas: replicas.replicas })
    const run = inPage(page, RUN_CHECKS, { url: `${origin}/dist/index.mjs`, options: checkOptions(proxy.port, tokens, replicas.checks(withReplica.port)) })
    const result: any = await bounded('the checks in Chromium', run, report)
    assert.ok(result.ok === true, `the checks passed in Chromium: ${result.error}\n${report()}`)
    assertChecks(result.out, 'Chromium', report())

    // The page really loaded the built ES modules, chunks included, as JavaScript.
    const modules = site.served.filter((s) => s.path.startsWith('/dist/'))
    assert.ok(modules.some((s) => s.path === '/dist/index.mjs' && s.status === 200), `dist/index.mjs was served; ${report()}`)
    assert.ok(modules.some((s) => s.path.startsWith('/dist/chunks/') && s.status === 200), `a chunk under dist/chunks/ was served; ${report()}`)
    assert.ok(modules.every((s) => s.status === 200 && s.type === 'text/javascript'), `every module was served as text/javascript; ${report()}`)

    // httpSql was cross-origin: the browser asked first (preflight), then POSTed; both allowed.
    const outcomes = sqlLogs.map((l) => `${l.status} ${l.outcome}`)
    assert.ok(outcomes.includes('204 preflight'), `the browser sent a CORS preflight to /sql: ${JSON.stringify(outcomes)}`)
    assert.equal(outcomes.filter((o) => o === '200 ok').length, 2, `both httpSql queries answered: ${JSON.stringify(outcomes)}`)
    assert.equal(problems.length, 0, `no console errors or page errors; ${report()}`)
  } finally {
    await close()
  }
})

test("a proxy with the default (no allowed Origins) refuses the page's WebSocket, saying why in the Client's error, and its /sql preflight", async () => {
  const { proxy, sqlLogs } = await proxyFor()
  const { page, report, close } = await openPage()
  try {
    const run = inPage(page, TRY_REFUSED, { url: `${origin}/dist/index.mjs`, options: checkOptions(proxy.port) })
    const got: any = await bounded('the refused attempts in Chromium', run, report)
    // The browser hides the refused upgrade's answer; the client asked the proxy why, and says it.
    assert.equal(got.client, `Error: edgepg: WebSocket to ws://127.0.0.1:${proxy.port}/v2 was refused (HTTP 403): origin ${origin} is not allowed (--allow-origin)`, report())
    assert.equal(got.wrongPath, `Error: edgepg: WebSocket to ws://127.0.0.1:${proxy.port}/v3 was refused (HTTP 404): no WebSocket route at /v3; use /v1 or /v2`, report())
    assert.match(got.http, /^HttpSqlError: /, `httpSql failed; ${report()}`)

    // The proxy refused them for their Origin (the browser's own), not for anything else.
    const refused = (await proxy.metrics.registry.getSingleMetric('edgepg_proxy_upgrades_refused_total')!.get()).values
    assert.equal(refused.find((v) => v.labels.reason === 'origin')?.value, 1, `one upgrade refused for its Origin: ${JSON.stringify(refused)}`)
    const outcomes = sqlLogs.map((l) => `${l.status} ${l.outcome}`)
    assert.deepEqual(outcomes, ['403 refused: origin'], 'the preflight was refused for its Origin, so the browser never sent the POST')
    assert.match(report(), /blocked by CORS policy/, `Chromium blocked the request for CORS; ${report()}`)
  } finally {
    await close()
  }
})

test("a limit's refusal reaches the page's Client too: the proxy tells the client that asks what it refused it", async () => {
  const { proxy } = await proxyFor({ allowedOrigins: [origin], maxSessionsPerIp: 1 })
  const { page, report, close } = await openPage()
  try {
    const run = inPage(
      page,
      `async ({ url, options }) => {
        const { Client } = await import(url)
        const { proxyPort, host, port, database, password } = options
        const open = () => new Client({ host, port, database, user: 'scram_user', password, wsProxy: () => 'ws://127.0.0.1:' + proxyPort + '/v2' })
        const first = open()
        await first.connect()
        const second = await open().connect().then(() => 'no error', (err) => err.message)
        await first.end()
        return second
      }`,
      { url: `${origin}/dist/index.mjs`, options: checkOptions(proxy.port) }
    )
    const second: string = await bounded('two sessions from the page', run, report)
    assert.equal(second, `edgepg: WebSocket to ws://127.0.0.1:${proxy.port}/v2 was refused (HTTP 429): too many sessions from 127.0.0.1 (1)`, report())
  } finally {
    await close()
  }
})
