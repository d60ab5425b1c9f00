/**
 * For the bench's child servers (started by bench/proxy.ts): once `server` listens, say where, as
 * {"listening":"127.0.0.1:PORT"} on stdout, and exit when stdin closes (the parent died).
 */
import type { AddressInfo } from 'node:net'

export function announce(server: { address(): AddressInfo | string | null }) {
  const { port } = server.address() as AddressInfo
  process.stdout.write(JSON.stringify({ listening: `127.0.0.1:${port}` }) + '\n')
  process.stdin.resume()
  process.stdin.on('end', () => process.exit(0))
  process.stdin.on('error', () => process.exit(0))
}
