/**
 * Two edgepg-proxy processes behind a real HAProxy (Debian's; .ci/run installs it), as
 * docs/deployment.md configures it (issue 23): a TCP frontend that sends the PROXY protocol
 * (v2) and an HTTP frontend that adds X-Forwarded-For, both health-checking /healthz. Sessions log
 * in through it (the login in the upgrade, pg-exact connect()), /sql answers through it, per-IP
 * limits count the real client (clients bind 127.0.0.2 and 127.0.0.3; HAProxy reaches the proxies
 * from 127.0.0.1, which they trust), and a proxy stopped with SIGTERM ends its sessions with 1001
 * while new ones reach the other.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, execFileSync, type ChildProcess } from 'node:child_process'
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import http from 'node:http'
import { connect as connectUnix } from 'node:net'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { startChildProxy, type ChildProxy } from './support/child-proxy'
import { edgeConfig, eventually, testPostgres, within } from './support/helpers'
import { freePort, PASSWORD } from './support/stack'
import { generateCerts } from './support/certs'
import { docBlock } from './support/doc-blocks'

const binary = (() => {
  try {
    return execFileSync('sh', ['-c', 'command -v haproxy || ls /usr/sbin/haproxy'], { encoding: 'utf8' }).trim()
  } catch {
    return undefined
  }
})()

let dir: string
let haproxy: ChildProcess | undefined
let proxies: ChildProxy[] = []
let tcpPort: number
let httpPort: number

/** HAProxy's config for the tests below: docs/deployment.md's, over plain TCP and HTTP, with this test's ports. */
const config = (backends: number[]) => `
global
  maxconn 2000
defaults
  timeout connect 2s
  timeout client 60s
  timeout server 60s
  timeout tunnel 1h
  retries 3
  option redispatch
frontend edge_tcp
  mode tcp
  bind 127.0.0.1:${tcpPort}
  default_backend proxies_tcp
backend proxies_tcp
  mode tcp
  balance roundrobin
  option httpchk GET /healthz
  http-check expect status 200
${backends.map((p, i) => `  server p${i} 127.0.0.1:${p} send-proxy-v2 check check-send-proxy inter 200 fall 1 rise 2`).join('\n')}
frontend edge_http
  mode http
  bind 127.0.0.1:${httpPort}
  option forwardfor
  default_backend proxies_http
backend proxies_http
  mode http
  balance roundrobin
  option httpchk GET /healthz
${backends.map((p, i) => `  server p${i} 127.0.0.1:${p} check inter 200 fall 1 rise 2`).join('\n')}
`

before(async () => {
  assert.ok(binary, 'haproxy is installed (apt-get install haproxy; .ci/run does)')
  const { host, port } = testPostgres()
  proxies = await Promise.all(
    [0, 1].map(() =>
      startChildProxy(`${host}:${port}`, {
        flags: ['--trust-proxy', '127.0.0.1', '--max-sessions-per-ip', '1', '--shutdown-grace', '300', '--allow-insecure-passwords'],
      })
    )
  )
  ;[tcpPort, httpPort] = [await freePort(), await freePort()]
  dir = await mkdtemp(join(tmpdir(), 'edgepg-haproxy-'))
  const file = join(dir, 'haproxy.cfg')
  await writeFile(file, config(proxies.map((p) => p.port)))
  haproxy = spawn(binary!, ['-db', '-f', file], { stdio: ['ignore', 'ignore', 'pipe'] })
  let stderr = ''
  haproxy.stderr!.on('data', (d) => (stderr += d))
  await eventually(async () => (await healthyThrough()) === 2 || haproxy!.exitCode !== null, 'HAProxy up, both proxies healthy', 15_000)
  assert.equal(haproxy.exitCode, null, `HAProxy exited: ${stderr}`)
})

after(async () => {
  haproxy?.kill('SIGTERM')
  await Promise.all(proxies.map((p) => p.stop()))
  if (dir) await rm(dir, { recursive: true, force: true })
})

/** Sessions through HAProxy's TCP frontend both proxies answer, judged by two fresh /healthz through the HTTP one. */
async function healthyThrough(): Promise<number> {
  const answers = await Promise.all([0, 1].map(() => get(httpPort, '/healthz').then((r) => r.status, () => 0)))
  return answers.filter((s) => s === 200).length
}

function get(port: number, path: string, localAddress = '127.0.0.2'): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    const req = http.get({ host: '127.0.0.1', port, path, localAddress, agent: false }, (res) => {
      let body = ''
      res.on('data', (d) => (body += d))
      res.on('end', () => resolve({ status: res.statusCode!, body }))
    })
    req.on('error', reject)
  })
}

/** What HAProxy's stats socket at `path` answers `command`. */
function ask(path: string, command: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const socket = connectUnix(path)
    let text = ''
    socket.on('data', (d) => (text += d)).on('end', () => resolve(text)).on('error', reject)
    socket.end(`${command}\n`)
  })
}

/** A `ws` WebSocket whose connection comes from `localAddress` (a client other than HAProxy's 127.0.0.1). */
const From = (localAddress: string) =>
  class extends WebSocket {
    constructor(url: string, protocols?: string | string[]) {
      super(url, protocols, { localAddress } as any)
    }
  }

function client(localAddress: string, port = tcpPort) {
  const c = new Client(edgeConfig(port, 'scram_user', { webSocketConstructor: From(localAddress) as any }))
  c.on('error', () => {})
  return c
}

test('through HAProxy (PROXY protocol v2): pg-exact connect(), per-IP limits by the real client, /sql with X-Forwarded-For', async () => {
  // Two from 127.0.0.2, one on each proxy (round robin); a third is over its limit of 1 on either.
  const a = client('127.0.0.2')
  const b = client('127.0.0.2')
  await a.connect()
  await b.connect()
  assert.deepEqual((await a.query('SELECT 1 AS one')).rows, [{ one: 1 }])
  await assert.rejects(client('127.0.0.2').connect(), /429|too many sessions from 127\.0\.0\.2/)
  // Another client behind the same HAProxy has its own limit: were the balancer's address taken, it would be refused.
  const c = client('127.0.0.3')
  await c.connect()
  assert.deepEqual((await c.query('SELECT 2 AS two')).rows, [{ two: 2 }])
  // The proxies logged the real clients.
  await Promise.all([a, b, c].map((x) => x.end()))
  await eventually(() => proxies.flatMap((p) => p.logs).filter((l) => l.peer === '127.0.0.2').length === 2, 'sessions of 127.0.0.2 logged')
  assert.ok(!proxies.flatMap((p) => p.logs).some((l) => l.peer === '127.0.0.1'), 'no session logged as HAProxy')

  // /sql through the HTTP frontend: the proxies take the client from X-Forwarded-For.
  const { host, port, database } = testPostgres()
  const answer = await new Promise<{ status: number; body: string }>((resolve, reject) => {
    const body = JSON.stringify({ query: 'SELECT $1::int AS n', params: [7] })
    const req = http.request(
      { host: '127.0.0.1', port: httpPort, path: '/sql', method: 'POST', localAddress: '127.0.0.3', agent: false, headers: { 'neon-connection-string': `postgres://scram_user:${PASSWORD}@${host}:${port}/${database}`, 'content-type': 'application/json' } },
      (res) => {
        let text = ''
        res.on('data', (d) => (text += d))
        res.on('end', () => resolve({ status: res.statusCode!, body: text }))
      }
    )
    req.on('error', reject)
    req.end(body)
  })
  assert.equal(answer.status, 200, answer.body)
  assert.deepEqual(JSON.parse(answer.body).rows, [{ n: 7 }])
  await eventually(() => proxies.flatMap((p) => p.lines).some((l) => l.route === '/sql' && l.peer === '127.0.0.3'), '/sql logged with the client from X-Forwarded-For')
})

test('one proxy stopped with SIGTERM: its sessions end with 1001 and a clear error, /healthz takes it out, new sessions reach the other', async () => {
  const sessions = [client('127.0.0.4'), client('127.0.0.5'), client('127.0.0.6'), client('127.0.0.7')]
  await Promise.all(sessions.map((s) => s.connect()))
  const errors = sessions.map((s) => new Promise<Error>((resolve) => s.on('error', resolve)))
  const [stopping, staying] = proxies
  const exited = new Promise((resolve) => stopping.child.once('exit', resolve))
  stopping.child.kill('SIGTERM')
  await within(10_000, 'the proxy to drain and exit', exited)
  // Round robin put sessions on both: those on the stopped one got its close, the rest go on.
  const outcomes = await Promise.all(sessions.map((s, i) => s.query('SELECT 3 AS three').then(() => 'ok', async () => (await errors[i]).message)))
  assert.ok(outcomes.includes('ok'), `sessions on the other proxy go on: ${outcomes}`)
  assert.ok(outcomes.some((o) => /1001.*shutting down/.test(o)), `sessions on the stopped proxy were told: ${outcomes}`)
  await eventually(async () => (await healthyThrough()) === 2 && (await get(httpPort, '/healthz')).status === 200, 'HAProxy to send health checks to the live one only')
  for (const address of ['127.0.0.8', '127.0.0.9', '127.0.0.10']) {
    const c = client(address)
    await c.connect()
    assert.deepEqual((await c.query('SELECT 4 AS four')).rows, [{ four: 4 }])
    await c.end()
  }
  assert.ok(staying.child.exitCode === null)
  await Promise.all(sessions.map((s) => s.end().catch(() => {})))
})

test("docs/deployment.md's config as written (its addresses this machine's): TLS end to end through TCP mode, PROXY v2, health checks over TLS", async () => {
  const certs = await generateCerts()
  const own = await Promise.all(
    [0, 1].map(() => startChildProxy(`${testPostgres().host}:${testPostgres().port}`, { flags: ['--cert', certs.server.certFile, '--key', certs.server.keyFile, '--trust-proxy', '127.0.0.1'] }))
  )
  const port = await freePort()
  const shown = docBlock('docs/deployment.md', 'frontend edge').code
  const config = shown
    .replace('bind :443', `bind 127.0.0.1:${port}`)
    .replace('10.0.0.11:443', `127.0.0.1:${own[0].port}`)
    .replace('10.0.0.12:443', `127.0.0.1:${own[1].port}`)
  assert.notEqual(config.indexOf(`127.0.0.1:${own[1].port}`), -1, 'the page has the two servers it had')
  // Around it, a stats socket of the test's own: whether HAProxy's health checks pass.
  const stats = join(dir, 'docs-haproxy.sock')
  const file = join(dir, 'docs-haproxy.cfg')
  await writeFile(file, `global\n  stats socket ${stats}\n${config}`)
  const balancer = spawn(binary!, ['-db', '-f', file], { stdio: ['ignore', 'ignore', 'pipe'] })
  let stderr = ''
  balancer.stderr!.on('data', (d) => (stderr += d))
  // Trusting the tests' CA, from 127.0.0.8: a client HAProxy's PROXY header names.
  const Trusting = class extends WebSocket {
    constructor(url: string, protocols?: string | string[]) {
      super(url, protocols, { ca: certs.ca.cert, localAddress: '127.0.0.8' } as any)
    }
  }
  const connect = async () => {
    const c = new Client({ ...edgeConfig(port, 'scram_user'), webSocketConstructor: Trusting as any, wsProxy: () => `wss://localhost:${port}/v2` })
    c.on('error', () => {})
    await c.connect()
    return c
  }
  try {
    // Each server passes its health check (over TLS, with the PROXY header) once HAProxy is up.
    const seenUp = new Set<string>()
    await eventually(async () => {
      for (const [, name] of (await ask(stats, 'show servers state proxies').catch(() => '')).matchAll(/^\d+ proxies \d+ (\w+) \S+ 2 /gm)) seenUp.add(name)
      return seenUp.size === 2 || balancer.exitCode !== null
    }, 'both servers UP in HAProxy', 30_000).catch(() => assert.fail(`servers seen UP: ${[...seenUp]}; HAProxy said: ${stderr}`))
    // Sessions through it, each logged by the proxy that served it with the real client.
    // (A busy machine may fail a health check, inter 1s, and a connection meets a server going down: a client would try again.)
    const failures: string[] = []
    for (let done = 0; done < 4 && failures.length < 10; ) {
      const c = await within(20_000, 'a session through HAProxy', connect()).catch((err: Error) => void failures.push(err.message))
      if (!c) continue
      assert.deepEqual((await c.query('SELECT 1 AS one')).rows, [{ one: 1 }])
      await c.end()
      done++
    }
    const served = () => own.flatMap((p) => p.logs).filter((l) => l.peer === '127.0.0.8').length
    await eventually(() => served() >= 4, `four sessions logged with the real client (failed attempts: ${failures.join('; ')}; HAProxy said: ${stderr})`)
    assert.ok(!own.flatMap((p) => p.logs).some((l) => l.peer === '127.0.0.1'), 'no session logged as HAProxy')
  } finally {
    balancer.kill('SIGTERM')
    await Promise.all(own.map((p) => p.stop()))
    await certs.cleanup()
  }
})
