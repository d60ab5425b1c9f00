/**
 * Starts the edgepg-proxy the benchmarks go through: by default as a child process
 * (`node --import tsx proxy/cli.ts`), as it runs in reality, so its relaying does not share the
 * measuring process's event loop and CPU; `--proxy=in-process` uses createProxy() directly.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { createProxy } from '../proxy/index'
import { freePort } from '../test/stack'
import type { ProxyMode } from './lib'

export interface RunningProxy {
  port: number
  url: string
  mode: ProxyMode
  stop(): Promise<void>
}

const root = fileURLToPath(new URL('..', import.meta.url))

export async function startProxy(upstream: string, mode: ProxyMode): Promise<RunningProxy> {
  if (mode === 'in-process') {
    const proxy = createProxy({ upstream })
    const { port } = await proxy.listen(0, '127.0.0.1')
    return { port, url: `ws://127.0.0.1:${port}/v2`, mode, stop: () => proxy.close() }
  }
  // The CLI refuses port 0, so pick a free port here (a tiny race, harmless on a bench machine).
  const listen = `127.0.0.1:${await freePort()}`
  const child = spawn(process.execPath, ['--import', 'tsx', 'proxy/cli.ts', '--upstream', upstream, '--listen', listen], {
    cwd: root,
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  let stderr = ''
  child.stderr!.on('data', (d) => (stderr += d))
  try {
    const port = await new Promise<number>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error('edgepg-proxy child did not report listening within 20 s')), 20_000)
      child.once('error', reject)
      child.once('exit', (code) => reject(new Error(`edgepg-proxy child exited (code ${code}) before listening: ${stderr.trim()}`)))
      createInterface({ input: child.stdout! }).on('line', (line) => {
        try {
          const msg = JSON.parse(line)
          if (msg.listening) {
            clearTimeout(timer)
            resolve(Number(String(msg.listening).split(':').pop()))
          }
        } catch {}
      })
    })
    return { port, url: `ws://127.0.0.1:${port}/v2`, mode, stop: () => stopChild(child) }
  } catch (err) {
    await stopChild(child)
    throw err
  }
}

function stopChild(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve()
  return new Promise((resolve) => {
    const timer = setTimeout(() => child.kill('SIGKILL'), 3000)
    child.once('exit', () => {
      clearTimeout(timer)
      resolve()
    })
    child.kill('SIGTERM')
  })
}
