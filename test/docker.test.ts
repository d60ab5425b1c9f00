/**
 * The Dockerfile's runtime stage as written, outside a container (none runs here): its `npm ci
 * --omit=dev` in a directory of its own, the built dist/ copied in, its ENTRYPOINT run there with its
 * ENV (ports moved to free ones on loopback) as a user would set EDGEPG_UPSTREAM, its HEALTHCHECK
 * command healthy, then unhealthy when Postgres is out of reach, and STOPSIGNAL draining to exit 0.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile, spawn } from 'node:child_process'
import { cpSync, mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'
import { freePort, testPostgres } from './support/stack'
import { eventually } from './support/helpers'
import { docBlock } from './support/doc-blocks'

const run = promisify(execFile)
const root = fileURLToPath(new URL('..', import.meta.url))
const dockerfile = readFileSync(join(root, 'Dockerfile'), 'utf8')
/** The runtime stage: after the last FROM. */
const stage = dockerfile.slice(dockerfile.lastIndexOf('\nFROM '))
const app = mkdtempSync(join(tmpdir(), 'edgepg-docker-'))

/** Its instructions, each on one line (continuations joined). */
const joined = stage.replace(/\\\n\s*/g, '')
/** An instruction's JSON-array form (ENTRYPOINT, HEALTHCHECK's CMD). */
const execForm = (instruction: RegExp) => JSON.parse(instruction.exec(joined)![1]) as string[]
const entrypoint = execForm(/^ENTRYPOINT (\[.*\])$/m)
const healthcheck = execForm(/^HEALTHCHECK .*CMD (\[.*\])$/m)
const env = Object.fromEntries([...joined.matchAll(/^ENV (.*)$/gm)].flatMap((m) => [...m[1].matchAll(/(\w+)=(\S+)/g)].map((kv) => [kv[1], kv[2]])))

before(async () => {
  for (const f of ['package.json', 'package-lock.json']) cpSync(join(root, f), join(app, f))
  const install = /^RUN (npm ci --omit=dev[^&]*)/m.exec(stage)![1].trim().split(/\s+/)
  await run(install[0], [...install.slice(1), '--prefer-offline', '--loglevel=error'], { cwd: app, timeout: 240_000 })
  cpSync(join(root, 'dist'), join(app, 'dist'), { recursive: true }) // (COPY --from=build: npm test built it)
})

after(() => rmSync(app, { recursive: true, force: true }))

async function container(upstream: string) {
  const [port, adminPort] = [await freePort(), await freePort()]
  assert.deepEqual([env.EDGEPG_LISTEN, env.EDGEPG_ADMIN_LISTEN], ['0.0.0.0:8080', '0.0.0.0:9464'])
  const proxy = spawn(entrypoint[0], entrypoint.slice(1), {
    cwd: app,
    env: { PATH: process.env.PATH, ...env, EDGEPG_LISTEN: `127.0.0.1:${port}`, EDGEPG_ADMIN_LISTEN: `127.0.0.1:${adminPort}`, EDGEPG_UPSTREAM: upstream, EDGEPG_WORKERS: '1' },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  let out = ''
  proxy.stdout!.setEncoding('utf8').on('data', (c) => (out += c))
  proxy.stderr!.setEncoding('utf8').on('data', (c) => (out += c))
  const exit = new Promise<number | null>((resolve) => proxy.once('exit', resolve))
  await eventually(() => out.includes('"admin"') && out.includes('"listening"'), 'the proxy to listen', 20_000).catch((err) => assert.fail(`${err.message}: ${out}`))
  const healthy = () =>
    run(healthcheck[0], healthcheck.slice(1).map((a) => a.replace('127.0.0.1:9464', `127.0.0.1:${adminPort}`)), { timeout: 3000 }).then(() => true, () => false)
  return { proxy, exit, healthy, out: () => out }
}

test("ENTRYPOINT after the runtime stage's npm ci --omit=dev: the proxy runs on production dependencies; HEALTHCHECK passes; SIGTERM exits 0", async () => {
  // docs/deployment.md's `docker run`: the port it publishes is the one the image listens on, and what it sets is the upstream this test gives.
  const shown = docBlock('docs/deployment.md', 'docker run').code
  const [, published, variable] = /docker run .*-p \d+:(\d+) -e (\w+)=\S+ edgepg-proxy/.exec(shown)!
  assert.equal(`0.0.0.0:${published}`, env.EDGEPG_LISTEN)
  assert.match(stage, new RegExp(`^EXPOSE ${published}$`, 'm'))
  assert.equal(variable, 'EDGEPG_UPSTREAM')
  const { host, port } = testPostgres()
  const c = await container(`${host}:${port}`)
  try {
    assert.equal(await c.healthy(), true, c.out())
    c.proxy.kill(/^STOPSIGNAL (\w+)$/m.exec(stage)![1] as NodeJS.Signals)
    assert.equal(await c.exit, 0)
  } finally {
    c.proxy.kill('SIGKILL')
  }
})

test('HEALTHCHECK fails while Postgres is out of reach', async () => {
  const c = await container(`127.0.0.1:${await freePort()}`)
  try {
    assert.equal(await c.healthy(), false)
  } finally {
    c.proxy.kill('SIGKILL')
  }
})
