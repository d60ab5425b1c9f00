import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, type ChildProcess } from 'node:child_process'
import { copyFile } from 'node:fs/promises'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { generateCerts, presented } from './support/certs'
import { freePort, PASSWORD, testPostgres } from './support/stack'
import { eventually } from './support/helpers'

// edgepg-proxy as operators run it: the CLI, serving wss:// with --cert/--key, reloading them on
// SIGHUP without dropping sessions; and its refusal of bad settings.
const children = new Set<ChildProcess>()
after(() => children.forEach((c) => c.kill('SIGKILL')))

function cli(args: string[], env: Record<string, string> = {}) {
  const child = spawn(process.execPath, ['--import', 'tsx', 'proxy/cli.ts', ...args], { env: { ...process.env, EDGEPG_WORKERS: '1', ...env }, stdio: ['ignore', 'pipe', 'pipe'] })
  children.add(child)
  const out = { stdout: '', stderr: '' }
  child.stdout!.setEncoding('utf8').on('data', (c) => (out.stdout += c))
  child.stderr!.setEncoding('utf8').on('data', (c) => (out.stderr += c))
  const exit = new Promise<number | null>((resolve) => child.once('exit', (code) => (children.delete(child), resolve(code))))
  return { child, out, exit }
}


/**
 * Two certificates, and a proxy serving the first from files of its own (SIGHUP makes it read them
 * again); `swap()` puts the second in those files.
 */
async function liveCerts(extra: string[] = []) {
  const [a, b] = await Promise.all([generateCerts(), generateCerts()])
  const pg = testPostgres()
  const port = await freePort()
  const certFile = `${a.dir}/live-cert.pem`
  const keyFile = `${a.dir}/live-key.pem`
  await copyFile(a.server.certFile, certFile)
  await copyFile(a.server.keyFile, keyFile)
  const proxy = cli(['--upstream', `${pg.host}:${pg.port}`, '--listen', `127.0.0.1:${port}`, '--cert', certFile, '--key', keyFile, ...extra])
  const swap = async () => {
    await copyFile(b.server.certFile, certFile)
    await copyFile(b.server.keyFile, keyFile)
  }
  return { a, b, pg, port, proxy, swap, cleanup: () => Promise.all([a.cleanup(), b.cleanup()]) }
}

test('wss:// with --cert/--key; SIGHUP swaps the certificate without dropping sessions', async () => {
  const { a, b, pg, port, proxy, swap, cleanup } = await liveCerts()
  try {
    await eventually(() => proxy.out.stdout.includes('"listening"'), 'the proxy to listen', 20000)
    const both = a.ca.cert + b.ca.cert
    const client = new Client({
      host: 'localhost', port: pg.port, user: 'scram_user', password: PASSWORD, database: pg.database,
      webSocketConstructor: class extends WebSocket { constructor(url: string, p?: string | string[]) { super(url, p, { ca: both }) } } as any,
      wsProxy: () => `wss://localhost:${port}/v2`,
    })
    await client.connect()
    assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }])
    const before = await presented(port, a.ca.cert)

    await swap()
    proxy.child.kill('SIGHUP')
    await eventually(() => proxy.out.stdout.includes('certificate reloaded'), 'the reload to be logged')
    const after = await presented(port, b.ca.cert)
    assert.notEqual(after, before, 'new connections get the new certificate')
    const second = await client.query("SELECT 2 AS two").catch((e) => { console.log(proxy.out.stdout, proxy.out.stderr); throw e })
    assert.deepEqual(second.rows, [{ two: 2 }], "the running session kept going")
    await client.end()

    proxy.child.kill('SIGTERM')
    assert.equal(await proxy.exit, 0)
  } finally {
    proxy.child.kill('SIGKILL')
    await cleanup()
  }
})

test('--workers 2: SIGHUP to the primary reloads the certificate in every worker', async () => {
  const { a, b, port, proxy, swap, cleanup } = await liveCerts(['--workers', '2'])
  const count = (what: string) => proxy.out.stdout.split('\n').filter((l) => l.includes(what)).length
  try {
    await eventually(() => count('"listening"') === 2, 'both workers to listen', 20000)
    const before = await presented(port, a.ca.cert)
    await swap()
    proxy.child.kill('SIGHUP')
    await eventually(() => count('certificate reloaded') === 2, 'each worker to log its reload')
    // Connections go to the workers in turn: every one presents the new certificate.
    for (let i = 0; i < 6; i++) assert.notEqual(await presented(port, b.ca.cert), before)
    proxy.child.kill('SIGTERM')
    assert.equal(await proxy.exit, 0)
  } finally {
    proxy.child.kill('SIGKILL')
    await cleanup()
  }
})

test('bad settings: exit 2 with a message naming the flag or variable', async () => {
  const up = ['--upstream', '127.0.0.1:5432']
  const cases: Array<[string[], Record<string, string>, RegExp]> = [
    [[...up, '--upstream-sslmode', 'sometimes'], {}, /--upstream-sslmode must be disable, require, verify-ca or verify-full, got "sometimes"/],
    [[...up, '--upstream-sslmode', 'verify-full'], {}, /verify-full needs --upstream-ca/],
    [[...up, '--cert', '/nonexistent.pem'], {}, /--cert and --key go together/],
    [[...up, '--cert', '/nonexistent.pem', '--key', '/nonexistent.pem'], {}, /--cert: cannot read "\/nonexistent.pem": ENOENT/],
    [[...up, '--max-sessions', '0'], {}, /--max-sessions must be an integer ≥ 1, got "0"/],
    [[...up], { EDGEPG_IDLE_TIMEOUT: 'soon' }, /EDGEPG_IDLE_TIMEOUT must be a duration in ms or with a unit \(500ms, 5s, 2m, 1h\) ≥ 0, got "soon"/],
    [[...up], { EDGEPG_NO_AUTH_OFFLOAD: 'maybe' }, /EDGEPG_NO_AUTH_OFFLOAD must be true or false/],
    [[...up, '--handshake-timeout', '-5'], {}, /handshake-timeout/],
    [[...up, '--workers', '3', '--pool-size', '2'], {}, /--pool-size \(2\) must be at least --workers \(3\)/],
    [[...up, '--trust-proxy', '10.0.0.0/33'], {}, /"10\.0\.0\.0\/33" is not an address or a CIDR range/],
  ]
  const runs = cases.map(([args, env]) => cli(args, env))
  for (const [i, run] of runs.entries()) {
    assert.equal(await run.exit, 2, `${cases[i][0].join(' ')}: ${run.out.stderr}`)
    assert.match(run.out.stderr, cases[i][2])
  }
})
